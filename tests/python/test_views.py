"""Lock views: the only way to get an address. Valid inside the with block
only; __array_interface__ and DLPack on the host backend."""

import ctypes
import gc

import pytest

import dmem


def test_view_inside_block(rt):
    b = rt.alloc(128)
    b.write(bytes(range(128)))
    v = b.lock()
    assert isinstance(v, dmem.View)
    assert not v.locked
    with v as view:
        assert view is v
        assert v.locked
        assert b.lock_count == 1
        assert b.state == "resident"
        assert isinstance(v.ptr, int) and v.ptr != 0
        assert v.size == 128
        assert v.buffer is b
        assert v.stream is None
        # the address is real host memory on the host backend
        assert ctypes.string_at(v.ptr, 128) == bytes(range(128))
        ctypes.memset(v.ptr, 0xAB, 4)
    assert not v.locked
    assert b.lock_count == 0
    assert b.read(5) == b"\xab\xab\xab\xab\x04"


def test_view_retrieves_spilled_buffer(rt):
    b = rt.alloc(4096)
    b.write(b"k" * 4096)
    b.spill("disk")
    with b.lock() as v:
        assert b.state == "resident"
        assert ctypes.string_at(v.ptr, 4) == b"kkkk"


def test_view_on_stream(rt):
    b = rt.alloc(64)
    b.write(b"s" * 64)
    b.spill()
    s = rt.stream()
    with b.lock(s) as v:
        assert v.stream == int(s)
        assert ctypes.string_at(v.ptr, 2) == b"ss"  # synchronised on enter (host backend)
    with b.lock(stream=s):
        pass
    s.close()


ADDRESS_USES = [
    lambda v: v.ptr,
    lambda v: v.size,
    lambda v: v.__array_interface__,
    lambda v: v.__dlpack__(),
    lambda v: v.__dlpack_device__(),
]


@pytest.mark.parametrize("use", ADDRESS_USES)
def test_view_unusable_after_block(rt, use):
    b = rt.alloc(64)
    with b.lock() as v:
        use(v)
    with pytest.raises(dmem.NotLockedError) as ei:
        use(v)
    assert ei.value.status == -4
    assert "outside" in ei.value.detail


@pytest.mark.parametrize("use", ADDRESS_USES)
def test_view_unusable_before_block(rt, use):
    b = rt.alloc(64)
    v = b.lock()
    with pytest.raises(dmem.NotLockedError):
        use(v)


def test_view_not_reenterable(rt):
    b = rt.alloc(64)
    v = b.lock()
    with v:
        with pytest.raises(ValueError):
            v.__enter__()
    with pytest.raises(ValueError):
        with v:
            pass
    with pytest.raises(dmem.NotLockedError):
        v.__exit__(None, None, None)


def test_view_exit_on_exception(rt):
    b = rt.alloc(64)
    with pytest.raises(KeyError):
        with b.lock():
            assert b.lock_count == 1
            raise KeyError("inside")
    assert b.lock_count == 0


def test_nested_views_count_locks(rt):
    b = rt.alloc(64)
    with b.lock() as v1:
        with b.lock() as v2:
            assert b.lock_count == 2
            assert v1.ptr == v2.ptr
        assert b.lock_count == 1
        assert v1.ptr
    assert b.lock_count == 0


def test_view_entered_and_dropped_unlocks(rt):
    b = rt.alloc(64)
    v = b.lock()
    v.__enter__()
    assert b.lock_count == 1
    del v
    gc.collect()
    assert b.lock_count == 0


def test_view_no_cuda_array_interface_on_host(rt):
    b = rt.alloc(64)
    with b.lock() as v:
        assert not hasattr(v, "__cuda_array_interface__")
        with pytest.raises(AttributeError):
            v.__cuda_array_interface__


def test_array_interface(rt):
    b = rt.alloc(32)
    with b.lock() as v:
        ai = v.__array_interface__
        assert ai == {"shape": (32,), "typestr": "|u1", "data": (v.ptr, False),
                      "version": 3, "strides": None}


def test_dlpack_device_and_capsules(rt):
    b = rt.alloc(32)
    with b.lock() as v:
        assert v.__dlpack_device__() == (1, 0)  # kDLCPU
        cap = v.__dlpack__()
        assert "dltensor" in repr(cap) and "versioned" not in repr(cap)
        cap2 = v.__dlpack__(max_version=(1, 0))
        assert "dltensor_versioned" in repr(cap2)
        cap3 = v.__dlpack__(stream=None, max_version=(0, 8))
        assert "versioned" not in repr(cap3)
        v.__dlpack__(dl_device=(1, 0), copy=False)
        with pytest.raises(BufferError):
            v.__dlpack__(copy=True)
        with pytest.raises(BufferError):
            v.__dlpack__(dl_device=(2, 0))
        with pytest.raises(TypeError):
            v.__dlpack__(max_version="1.0")
        del cap, cap2, cap3  # unconsumed capsules release their view


def test_dlpack_capsule_keeps_view_alive(rt):
    import sys
    b = rt.alloc(32)
    with b.lock() as v:
        before = sys.getrefcount(v)
        caps = [v.__dlpack__() for _ in range(5)]
        assert sys.getrefcount(v) == before + 5
        del caps
        assert sys.getrefcount(v) == before


def test_numpy_array_interface(rt):
    np = pytest.importorskip("numpy")
    b = rt.alloc(256)
    b.write(bytes(range(256)))
    with b.lock() as v:
        a = np.asarray(v)
        assert a.dtype == np.uint8 and a.shape == (256,)
        assert a.tolist() == list(range(256))
        a += 1  # write through the view
        del a
    assert b.read() == bytes((i + 1) & 0xFF for i in range(256))


def test_numpy_from_dlpack(rt):
    np = pytest.importorskip("numpy")
    if not hasattr(np, "from_dlpack"):
        pytest.skip("numpy without from_dlpack")
    b = rt.alloc(1024)
    b.write(bytes(1024))
    b.spill("disk")
    with b.lock() as v:
        a = np.from_dlpack(v)
        assert a.shape == (1024,) and a.dtype == np.uint8
        assert a.ctypes.data == v.ptr
        a[:] = 7
        f = a.view(np.float32)  # reinterpret like a real consumer would
        assert f.shape == (256,)
        del a, f
    assert b.read() == b"\x07" * 1024
    b.spill("host")
    assert b.read(3) == b"\x07\x07\x07"


def test_numpy_after_spill_unspill(rt):
    np = pytest.importorskip("numpy")
    b = rt.alloc(4096)
    with b.lock() as v:
        np.asarray(v)[:] = np.arange(4096, dtype=np.uint32).astype(np.uint8)
    for tier in ("host", "disk"):
        b.spill(tier)
        with b.lock() as v:
            got = np.from_dlpack(v).copy()
        assert (got == np.arange(4096, dtype=np.uint32).astype(np.uint8)).all()
