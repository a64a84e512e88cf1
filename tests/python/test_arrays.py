"""dmem.arrays (arrays <-> buffers for any integration) and dmem.cupy's
recognition of its own memory, on the host backend without Dask and without
CuPy: CuPy arrays and memory are stand-ins with CuPy's attributes
(``array.data.mem._owner``, ``array.data.ptr``)."""

import gc
import pickle
import sys

import pytest

import dmem
import dmem.arrays
import dmem.cupy

np = pytest.importorskip("numpy")

MiB = 1 << 20


class _Ns:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def fake_cupy_array(owner, offset, payload):
    """What a CuPy array over `owner`'s memory looks like to dmem.arrays."""
    return _Ns(data=_Ns(mem=_Ns(_owner=owner), ptr=owner.ptr + offset), nbytes=payload.nbytes,
               shape=payload.shape, dtype=payload.dtype, strides=payload.strides)


class DeviceMemory:
    """A foreign class that happens to be called DeviceMemory and has every
    attribute dmem's has: it must never be taken for dmem's."""

    def __init__(self, runtime, ptr, size):
        self.runtime, self.ptr, self.size = runtime, ptr, size
        self.freed = False
        self.adopted = False


class SpyRuntime:
    """A runtime whose adopt records what it was handed (and passes it on)."""

    def __init__(self, rt):
        self.rt, self.backend, self.handed = rt, rt.backend, []

    def adopt(self, mem):
        self.handed.append(mem)
        return self.rt.adopt(mem)


# ---- recognition (dmem.cupy) ---------------------------------------------------------


def test_device_memory_recognises_dmems_memory_by_type(rt):
    mem = rt.device_malloc(4096)
    arr = fake_cupy_array(mem, 0, np.zeros(8))
    assert dmem.cupy.device_memory(arr.data.mem) is mem
    assert dmem.cupy.device_memory_of(arr) is mem
    # CuPy's own pool, another allocator, odd objects: not dmem's, no exception
    for other in (None, 0, "DeviceMemory", _Ns(), _Ns(_owner=None), _Ns(_owner=mem.ptr),
                  _Ns(_owner=_Ns(ptr=mem.ptr, size=4096))):
        assert dmem.cupy.device_memory(other) is None
        assert dmem.cupy.device_memory_of(_Ns(data=_Ns(mem=other))) is None
    assert dmem.cupy.device_memory_of(np.zeros(3)) is None  # no .data.mem
    assert dmem.cupy.device_memory_of(None) is None


def test_a_foreign_class_named_devicememory_is_not_dmems(rt):
    mem = rt.device_malloc(4096)
    foreign = DeviceMemory(rt, mem.ptr, 4096)
    assert type(foreign).__name__ == "DeviceMemory"
    assert dmem.cupy.device_memory(_Ns(_owner=foreign)) is None
    payload = np.arange(16, dtype=np.float64)
    # the spy's runtime is the foreign object's runtime: every attribute
    # check that a class-name test would pass on passes here
    spy = SpyRuntime(rt)
    foreign.runtime = spy
    src = fake_cupy_array(foreign, 0, payload)
    assert dmem.cupy.device_memory_of(src) is None
    assert dmem.arrays.adopt(spy, src, "cupy") is None
    assert spy.handed == []  # never handed to the runtime as dmem's memory
    assert not mem.adopted and rt.stats()["raw_used"] == 4096


def test_adopt_takes_the_runtimes_own_memory_once(rt):
    mem = rt.device_malloc(4096)
    payload = np.arange(64, dtype=np.int32)
    spy = SpyRuntime(rt)
    # mem.runtime is rt, not the spy: another runtime's memory is not adopted
    assert dmem.arrays.adopt(spy, fake_cupy_array(mem, 0, payload), "cupy") is None
    assert spy.handed == []
    # out of the block's bounds: not adopted
    assert dmem.arrays.adopt(rt, fake_cupy_array(mem, 4096 - 8, payload), "cupy") is None
    src = fake_cupy_array(mem, 512, payload)
    leaf = dmem.arrays.adopt(rt, src, "cupy")
    assert leaf is not None and leaf.adopted and leaf.offset == 512 and leaf.kind == "cupy"
    assert leaf.nbytes == payload.nbytes and leaf.shape == payload.shape
    assert mem.adopted and leaf.buf.lock_count == 1 and rt.stats()["raw_used"] == 0
    assert dmem.arrays.adopt(rt, src, "cupy") is None  # adopted already: copy instead
    del src, mem
    gc.collect()
    assert leaf.buf.lock_count == 0
    dmem.arrays.discard(leaf)
    dmem.arrays.discard(leaf)  # a second discard is quiet
    assert rt.stats()["buffer_count"] == 0


# ---- arrays in buffers (host backend: NumPy arrays) ---------------------------------


def test_array_kind_on_the_host_backend(rt):
    assert dmem.arrays.array_kind(rt, np.zeros(4)) == "numpy"
    assert dmem.arrays.array_kind(rt, np.zeros(0)) is None  # empty
    assert dmem.arrays.array_kind(rt, np.array([object()])) is None  # object dtype
    assert dmem.arrays.array_kind(rt, b"bytes") is None
    assert dmem.arrays.array_kind(rt, np.zeros(4).view(np.matrix)) is None  # a subclass


def test_store_expose_peek_discard(rt):
    a = np.arange(60, dtype=np.float32).reshape(6, 10)[::2, 1::3]  # not contiguous
    leaf = dmem.arrays.store(rt, a, "numpy")
    assert not leaf.adopted and leaf.offset == 0 and leaf.nbytes == a.nbytes
    assert leaf.buf.lock_count == 0
    got = dmem.arrays.expose(leaf)
    assert type(got) is np.ndarray
    np.testing.assert_array_equal(got, a)
    assert leaf.buf.lock_count == 1  # locked while the exposed array lives
    view = got[1:]
    del got
    gc.collect()
    assert leaf.buf.lock_count == 1  # a view keeps it
    del view
    gc.collect()
    assert leaf.buf.lock_count == 0
    leaf.buf.spill("disk")
    assert dmem.arrays.peek(leaf) == np.ascontiguousarray(a).tobytes()
    assert leaf.buf.state == "deferred_disk"  # peek does not bring it back
    with pytest.raises(TypeError):
        pickle.dumps(leaf)
    dmem.arrays.discard(leaf)
    assert rt.stats()["buffer_count"] == 0


def test_pack_unpack_and_transfer_form(rt):
    value = {"x": np.ones((3, 4)), "meta": ("label", [np.arange(5, dtype=np.int8), 7]),
             "f": np.asfortranarray(np.arange(12.0).reshape(3, 4))}
    tree, leaves = dmem.arrays.pack(rt, value)
    assert len(leaves) == 3 and dmem.arrays.leaves_of(tree) == leaves
    assert rt.stats()["buffer_count"] == 3
    out = dmem.arrays.unpack(tree)
    assert out["meta"][0] == "label" and out["meta"][1][1] == 7
    np.testing.assert_array_equal(out["x"], value["x"])
    np.testing.assert_array_equal(out["meta"][1][0], value["meta"][1][0])
    assert out["f"].flags.f_contiguous
    del out
    gc.collect()
    skel = pickle.loads(pickle.dumps(dmem.arrays.skeleton(tree)))
    again = dmem.arrays.rebuild(skel, [dmem.arrays.peek(leaf) for leaf in leaves], False)
    np.testing.assert_array_equal(again["f"], value["f"])
    got = dmem.arrays.materialize(tree, False)
    np.testing.assert_array_equal(got["x"], value["x"])
    assert all(leaf.buf.lock_count == 0 for leaf in leaves)
    for leaf in leaves:
        dmem.arrays.discard(leaf)
    assert dmem.arrays.pack(rt, {"a": 1, "b": [b"x"]}) == (None, [])


def test_pack_frees_what_it_made_when_it_fails(rt):
    # the second array is larger than the simulated device: its alloc fails
    value = [np.ones(1000), {"big": np.ones((64 << 20) // 8)}]
    with pytest.raises(dmem.OutOfMemoryError):
        dmem.arrays.pack(rt, value)
    assert rt.stats()["buffer_count"] == 0


def test_import_needs_neither_cupy_nor_numba_nor_dask():
    from conftest import run_python

    r = run_python("""
        import sys
        for name in ("cupy", "numba", "dask", "distributed"):
            sys.modules[name] = None  # any import of them fails
        import dmem.arrays, dmem.cupy
        assert not [m for m in ("cupy", "numba", "dask", "distributed") if sys.modules.get(m)]
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout


def test_dmem_dask_uses_dmem_arrays():
    pytest.importorskip("distributed")
    from dmem.dask import data, ipc, serialize

    for m in (data, ipc, serialize):
        assert m._arrays is dmem.arrays
    assert "dmem.dask._arrays" not in sys.modules
