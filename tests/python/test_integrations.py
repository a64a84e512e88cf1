"""The allocator hooks without a GPU (host backend): the default runtime and
configure(), raw allocations (DeviceMemory), the CuPy allocator's C path
over stand-in CuPy classes, the Numba EMM plugin over a stand-in numba
package, the PyTorch symbols of the loaded libdmem, and the imports that
must work without Numba, CuPy or PyTorch.

Everything that touches the process-wide default runtime runs in a fresh
interpreter (run_python), so each test configures its own."""

import ctypes
import gc
import os
import textwrap

import pytest

import dmem
from conftest import run_python

HOST = {"DMEM_BACKEND": "host", "DMEM_HOST_CAPACITY": "64MiB"}


def check(code, env=None, timeout=120):
    r = run_python(code, timeout=timeout, env_extra=dict(HOST, **(env or {})))
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r.stdout


# ---- imports without the libraries ----------------------------------------------

def test_modules_import_without_numba_cupy_torch():
    out = check("""
        import sys
        for name in ("numba", "cupy", "torch"):
            sys.modules[name] = None          # as if not installed
        import dmem, dmem.numba, dmem.cupy, dmem.torch
        assert not [m for m in ("numba.cuda", "cupy.cuda", "torch.cuda") if sys.modules.get(m)]
        for what, f, pkg in [
                ("DmemNumbaManager", lambda: dmem.numba.DmemNumbaManager, "numba-cuda"),
                ("_numba_memory_manager", lambda: dmem.numba._numba_memory_manager, "numba-cuda"),
                ("use_dmem_for_numba", dmem.numba.use_dmem_for_numba, "numba-cuda"),
                ("cupy allocator", lambda: dmem.cupy.allocator, "CuPy"),
                ("use_dmem_for_cupy", dmem.cupy.use_dmem_for_cupy, "CuPy"),
                ("torch allocator", dmem.torch.allocator, "PyTorch"),
                ("use_dmem_for_torch", dmem.torch.use_dmem_for_torch, "PyTorch")]:
            try:
                f()
            except ImportError as e:
                assert pkg in str(e), (what, str(e))
            else:
                raise AssertionError(what + " did not raise ImportError")
        try:
            dmem.numba.no_such_name
        except AttributeError:
            pass
        print("ok")
    """)
    assert "ok" in out


def test_import_creates_no_runtime():
    # Importing creates nothing (no default runtime, so configure still works).
    check("""
        import dmem, dmem.numba, dmem.cupy, dmem.torch
        dmem.configure(device_limit="1MiB")
        assert dmem.default_runtime().stats()["device_limit"] == 1 << 20
    """)


# ---- the default runtime and configure -------------------------------------------------

def test_default_runtime_is_one_per_device():
    check("""
        import dmem
        a = dmem.default_runtime()
        assert a is dmem.default_runtime() is dmem.default_runtime(0)
        assert a.is_default and a.device == 0 and a.backend == "host"
        b = dmem.default_runtime(1)
        assert b is not a and b.device == 1 and b.is_default
        assert not dmem.Runtime(backend="host", host_capacity=1 << 20).is_default
        with dmem.default_runtime() as rt:        # the with block keeps it open
            buf = rt.alloc(100)
        assert not a.closed
        try:
            a.close()
        except dmem.InvalidArgumentError as e:
            assert "cannot be closed" in str(e)
        else:
            raise AssertionError("close() of the default runtime did not raise")
        assert not a.closed and buf.size == 100
        assert "default" in repr(a)
    """)


def test_default_runtime_device_from_environment_and_configure():
    check("""
        import dmem
        assert dmem.default_runtime().device == 2
    """, env={"DMEM_DEVICE": "2"})
    check("""
        import dmem
        dmem.configure(device=3, device_limit="2MiB")
        rt = dmem.default_runtime()
        assert rt.device == 3 and rt.stats()["device_limit"] == 2 << 20
    """)


def test_configure_before_first_use_sets_limits():
    check("""
        import dmem, tempfile
        tmp = tempfile.TemporaryDirectory()   # removed when the child exits
        d = tmp.name
        dmem.configure(device_limit="3MiB", host_limit=1 << 20, spill_dir=d)
        dmem.configure(device_limit="4MiB", spill_dir=d)   # again before use: replaces
        rt = dmem.default_runtime()
        assert rt.stats()["device_limit"] == 4 << 20
        try:
            rt.device_malloc(5 << 20)
        except dmem.OutOfMemoryError:
            pass
        else:
            raise AssertionError("no OutOfMemoryError past the configured limit")
        try:
            dmem.configure(device_limit="8MiB")
        except dmem.BusyError as e:
            assert "before" in str(e)
        else:
            raise AssertionError("configure() after first use did not raise")
        assert rt.stats()["device_limit"] == 4 << 20
    """)


def test_configure_and_default_runtime_reject_bad_arguments():
    check("""
        import dmem
        for kw, exc in [({"device_limit": "lots"}, ValueError), ({"device_limit": -1}, ValueError),
                        ({"device_limit": 1.5}, TypeError), ({"backend": "gpu"}, ValueError),
                        ({"backend": 1}, TypeError), ({"device": "0"}, TypeError),
                        ({"device": -1}, ValueError), ({"host_capacity": 0}, ValueError),
                        ({"nonsense": 1}, TypeError)]:
            try:
                dmem.configure(**kw)
            except exc:
                pass
            else:
                raise AssertionError(f"configure({kw}) did not raise {exc.__name__}")
        try:
            dmem.configure("1M")              # keyword-only
        except TypeError:
            pass
        else:
            raise AssertionError("positional configure() accepted")
        for arg, exc in [("0", TypeError), (True, TypeError), (-1, ValueError), (64, ValueError)]:
            try:
                dmem.default_runtime(arg)
            except exc:
                pass
            else:
                raise AssertionError(f"default_runtime({arg!r}) did not raise {exc.__name__}")
    """)


def test_malformed_environment_is_a_config_error_at_first_use():
    check("""
        import dmem
        try:
            dmem.default_runtime()
        except dmem.ConfigError as e:
            assert "DMEM_DEVICE_LIMIT" in str(e)
        else:
            raise AssertionError("no ConfigError")
    """, env={"DMEM_DEVICE_LIMIT": "lots"})


def test_forked_child_gets_its_own_default_runtime():
    check("""
        import os, dmem
        rt = dmem.default_runtime()
        m = rt.device_malloc(4096)
        pid = os.fork()
        if pid == 0:
            ok = False
            try:
                assert m.freed                    # the parent's runtime is disowned here
                m.free()                          # and freeing into it does nothing
                c = dmem.default_runtime()
                assert c is not rt and c.is_default
                x = c.device_malloc(1000)
                ok = c.stats()["raw_used"] == 1000
            finally:
                os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
        assert rt.stats()["raw_used"] == 4096
    """)


# ---- raw allocations ------------------------------------------------------------------------

def test_device_malloc_counts_and_frees(rt):
    base = rt.stats()["raw_used"]
    m = rt.device_malloc(1000)
    assert isinstance(m, dmem.DeviceMemory)
    assert m.size == 1000 and m.ptr == int(m) and m.ptr % 256 == 0 and m.stream == 0
    assert not m.freed and m.runtime is rt
    assert rt.stats()["raw_used"] == base + 1000
    free, total = rt.memory_info()
    assert total == rt.stats()["device_limit"]
    assert free <= total - 1000
    m.free()
    assert m.freed and m.ptr == 0
    m.free()  # again: nothing
    assert rt.stats()["raw_used"] == base
    m2 = rt.device_malloc(2000)
    del m2  # collection frees
    gc.collect()
    assert rt.stats()["raw_used"] == base


def test_device_malloc_on_a_dmem_stream(rt):
    s = rt.stream()
    m = rt.device_malloc(4096, stream=s)
    assert m.stream == int(s)
    del s  # the DeviceMemory keeps the stream
    m.free()
    assert rt.stats()["raw_used"] == 0
    s2 = rt.stream()
    m2 = rt.device_malloc(4096, s2)
    s2.close()  # closed first: the block is freed on the default stream instead
    m2.free()
    assert rt.stats()["raw_used"] == 0


def test_device_malloc_dedicated_blocks(rt):
    base = rt.stats()
    ms = [rt.device_malloc(n, dedicated=True) for n in (40, 4096, 3 << 20)]
    assert [m.size for m in ms] == [40, 4096, 3 << 20]
    assert all(m.ptr % 256 == 0 for m in ms)
    spans = sorted((m.ptr, m.ptr + m.size) for m in ms)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap
    st = rt.stats()
    assert st["raw_used"] == base["raw_used"] + 40 + 4096 + (3 << 20)
    assert st["device_reserved"] >= st["raw_used"]
    p = ms[1].ptr
    ms[1].free()
    again = rt.device_malloc(4096, dedicated=True)  # the cached block
    assert again.ptr == p
    misses = rt.stats()["pool_misses"]
    again.free()
    assert rt.device_malloc(4096, dedicated=True).ptr == p  # collected at once
    assert rt.stats()["pool_misses"] == misses
    for m in ms:
        m.free()
    gc.collect()
    assert rt.stats()["raw_used"] == base["raw_used"]
    with pytest.raises(TypeError):
        rt.device_malloc(64, None, True)  # keyword only
    with pytest.raises(dmem.NoDeviceError):  # the host backend has no IPC
        rt.ipc_handle(rt.device_malloc(64, dedicated=True))


def test_device_malloc_rejects_bad_arguments(rt):
    with pytest.raises(TypeError):
        rt.device_malloc("1024")
    with pytest.raises(TypeError):
        rt.device_malloc(True)
    with pytest.raises(ValueError):
        rt.device_malloc(-1)
    with pytest.raises(ValueError):
        rt.device_malloc(0)
    with pytest.raises(TypeError):
        rt.device_malloc(64, stream=12345)  # host backend: no int streams
    with pytest.raises(dmem.OutOfMemoryError):
        rt.device_malloc(1 << 40)
    with pytest.raises(TypeError):
        rt.ipc_handle("0x10")
    with pytest.raises(dmem.NoDeviceError):  # the host backend has no IPC
        rt.ipc_handle(rt.device_malloc(64))
    assert rt.stats()["raw_used"] == 0


def test_free_after_close_is_safe(spill_dir):
    r = dmem.Runtime(backend="host", host_capacity=1 << 20, spill_dir=str(spill_dir))
    m = r.device_malloc(1000)
    r.close()
    assert m.freed
    m.free()  # the block went with the runtime: nothing to do, no crash
    del m
    m2 = dmem.Runtime(backend="host", host_capacity=1 << 20).device_malloc(64)
    gc.collect()  # the DeviceMemory keeps its runtime alive
    assert not m2.freed
    with pytest.raises(ValueError):
        r.device_malloc(10)
    with pytest.raises(ValueError):
        r.memory_info()


def test_raw_allocations_spill_buffers_and_memory_info_counts_them(spill_dir):
    limit = 4 << 20
    with dmem.Runtime(backend="host", host_capacity=16 << 20, device_limit=limit,
                      spill_dir=str(spill_dir)) as r:
        bufs = []
        for i in range(4):
            b = r.alloc(1 << 20)
            b.write(bytes([i]) * (1 << 20))
            bufs.append(b)
        free, total = r.memory_info()
        assert total == limit
        assert free >= (4 << 20) - 4096  # the buffers count as obtainable
        raw = r.device_malloc(3 << 20)  # needs three of the four buffers' room
        s = r.stats()
        assert s["raw_used"] == 3 << 20
        assert s["spill_count"] >= 2
        assert s["device_used"] <= limit
        for i, b in enumerate(bufs):
            assert b.read() == bytes([i]) * (1 << 20)  # retrieved on demand
        raw.free()
        assert r.stats()["raw_used"] == 0


# ---- the PyTorch symbols share the default runtime --------------------------------------------

def test_torch_symbols_use_the_default_runtime():
    check("""
        import ctypes, dmem, dmem.torch
        path = dmem.torch.library_path()
        assert "libdmem" in path
        lib = ctypes.CDLL(path)
        lib.dmem_torch_alloc.restype = ctypes.c_void_p
        lib.dmem_torch_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.dmem_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                        ctypes.c_void_p]
        rt = dmem.default_runtime()
        p = lib.dmem_torch_alloc(5000, 0, None)
        assert p and rt.stats()["raw_used"] == 5000      # one accounting point
        lib.dmem_torch_free(p, 5000, 0, None)
        assert rt.stats()["raw_used"] == 0
        # and the C default runtime is this one: configure now fails there too
        try:
            dmem.configure(device_limit="1MiB")
        except dmem.BusyError:
            pass
        else:
            raise AssertionError
    """)


def test_torch_symbols_create_the_default_runtime_python_sees():
    # The C side creates it first (as PyTorch would); Python gets that one.
    check("""
        import ctypes, dmem
        lib = ctypes.CDLL(dmem._dmem._library_path())
        lib.dmem_torch_alloc.restype = ctypes.c_void_p
        lib.dmem_torch_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        p = lib.dmem_torch_alloc(777, 0, None)
        assert dmem.default_runtime().stats()["raw_used"] == 777
    """)


# ---- the CuPy allocator's C path, over stand-ins for CuPy's classes ---------------------------

class FakeUnowned:
    def __init__(self, ptr, size, owner, device_id=-1):
        self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id


class FakePointer:
    def __init__(self, mem, offset):
        self.mem, self.ptr, self.device_id = mem, mem.ptr + offset, mem.device_id


def fake_allocator(runtime=None, device=0, stream=0):
    return dmem._dmem.CupyAllocator(FakeUnowned, FakePointer, lambda: device, lambda: stream,
                                    lambda: None, runtime)


def test_cupy_allocator_path(rt):
    alloc = fake_allocator(rt)
    assert not alloc.uses_c_api
    p = alloc(1000)
    assert isinstance(p, FakePointer) and isinstance(p.mem, FakeUnowned)
    assert p.ptr == p.mem.ptr != 0 and p.mem.size == 1000 and p.device_id == 0
    owner = p.mem.owner
    assert isinstance(owner, dmem.DeviceMemory) and owner.ptr == p.ptr
    assert rt.stats()["raw_used"] == 1000
    del p, owner  # CuPy drops the pointer: the owner frees the block
    assert rt.stats()["raw_used"] == 0
    z = alloc(0)  # empty arrays: a null pointer, nothing allocated
    assert z.ptr == 0 and z.mem.owner is None and z.mem.device_id == 0
    ptrs = [alloc(256) for _ in range(100)]
    assert len({p.ptr for p in ptrs}) == 100
    del ptrs
    assert rt.stats()["raw_used"] == 0


def test_cupy_allocator_rejects_bad_arguments(rt):
    alloc = fake_allocator(rt)
    with pytest.raises(TypeError):
        alloc("100")
    with pytest.raises(TypeError):
        alloc(1.0)
    with pytest.raises(TypeError):
        alloc()
    with pytest.raises(TypeError):
        alloc(10, 20)
    with pytest.raises(TypeError):
        alloc(nbytes=10)
    with pytest.raises(ValueError):
        alloc(-5)
    with pytest.raises(dmem.OutOfMemoryError):
        alloc(1 << 40)
    with pytest.raises(ValueError):  # host backend: only the default streams
        fake_allocator(rt, stream=0x1234)(64)
    with pytest.raises(ValueError):
        fake_allocator(rt, device=99)(64)
    with pytest.raises(TypeError):
        dmem._dmem.CupyAllocator(FakeUnowned, FakePointer, 0, lambda: 0, lambda: None)
    with pytest.raises(TypeError):
        dmem._dmem.CupyAllocator(FakeUnowned, FakePointer, lambda: 0, lambda: 0, lambda: None,
                                 runtime="rt")
    import ctypes as C

    cap = C.pythonapi.PyCapsule_New
    cap.restype = C.py_object
    cap.argtypes = [C.c_void_p, C.c_char_p, C.c_void_p]
    name = b"double (float)"  # kept alive as long as the capsule
    wrong = cap(C.cast(C.pythonapi.Py_IncRef, C.c_void_p).value, name, None)
    with pytest.raises(TypeError, match="C signature"):
        dmem._dmem.CupyAllocator(FakeUnowned, FakePointer, wrong, lambda: 0, lambda: None)

    def boom():
        raise RuntimeError("no device")

    with pytest.raises(RuntimeError, match="no device"):
        dmem._dmem.CupyAllocator(FakeUnowned, FakePointer, boom, lambda: 0, lambda: None, rt)(8)
    assert rt.stats()["raw_used"] == 0


def test_cupy_allocator_error_in_cupy_class_frees_the_block(rt):
    def unowned(ptr, size, owner, device_id):
        raise RuntimeError("CuPy refused")

    alloc = dmem._dmem.CupyAllocator(unowned, FakePointer, lambda: 0, lambda: 0, lambda: None, rt)
    with pytest.raises(RuntimeError, match="refused"):
        alloc(4096)
    assert rt.stats()["raw_used"] == 0


def test_cupy_allocator_construction_keeps_type_call_semantics(rt):
    # The classes are built by tp_new + tp_init with an argument tuple kept
    # between calls: an __init__ that keeps its arguments, one that allocates
    # again (reentrant), one that raises, a __new__ that returns another
    # object, and a metaclass with its own __call__ must all behave as
    # cls(*args) does.
    class Keeps(Exception):  # BaseException.__new__ keeps the very tuple it is given
        ptr, size, owner, device_id = (property(lambda s, i=i: s.args[i]) for i in range(4))

    alloc = dmem._dmem.CupyAllocator(Keeps, FakePointer, lambda: 0, lambda: 0, lambda: None, rt)
    ps = [alloc(256 * (i + 1)) for i in range(3)]
    assert [p.mem.size for p in ps] == [256, 512, 768]  # each call's own tuple, intact
    assert [p.mem.ptr for p in ps] == [p.ptr for p in ps] and ps[0].mem.owner.size == 256
    del ps
    assert rt.stats()["raw_used"] == 0

    inner = []

    class Reenters(FakeUnowned):
        def __init__(self, ptr, size, owner, device_id):
            super().__init__(ptr, size, owner, device_id)
            if size == 1000:
                inner.append(alloc2(2000))

    alloc2 = dmem._dmem.CupyAllocator(Reenters, FakePointer, lambda: 0, lambda: 0, lambda: None,
                                      rt)
    p = alloc2(1000)
    assert p.mem.size == 1000 and inner[0].mem.size == 2000 and inner[0].ptr != p.ptr
    assert rt.stats()["raw_used"] == 3000
    q = alloc2(3000)  # the kept tuples still work after the nesting
    assert q.mem.size == 3000 and q.mem.owner.size == 3000
    del p, q, inner[:]
    assert rt.stats()["raw_used"] == 0

    class Fails(FakeUnowned):
        def __init__(self, ptr, size, owner, device_id):
            if size == 512:
                raise RuntimeError("refused")
            super().__init__(ptr, size, owner, device_id)

    alloc3 = dmem._dmem.CupyAllocator(Fails, FakePointer, lambda: 0, lambda: 0, lambda: None, rt)
    with pytest.raises(RuntimeError, match="refused"):
        alloc3(512)
    assert rt.stats()["raw_used"] == 0
    assert alloc3(256).mem.size == 256

    other = object()

    class NewElse(FakeUnowned):  # __init__ is skipped when __new__ gives another type
        def __new__(cls, *args):
            return other

    ptr_new = dmem._dmem.CupyAllocator(FakeUnowned, NewElse, lambda: 0, lambda: 0, lambda: None,
                                       rt)
    assert ptr_new(256) is other
    assert rt.stats()["raw_used"] == 0

    class Meta(type):
        def __call__(cls, *args):
            return ("made", cls, args)

    class ViaMeta(metaclass=Meta):
        pass

    made = dmem._dmem.CupyAllocator(FakeUnowned, ViaMeta, lambda: 0, lambda: 0, lambda: None,
                                    rt)(256)
    assert made[0] == "made" and made[1] is ViaMeta and made[2][1] == 0
    assert made[2][0].size == 256
    del made
    assert rt.stats()["raw_used"] == 0


def test_cupy_allocator_over_the_default_runtime():
    check("""
        import dmem
        class U:
            def __init__(self, ptr, size, owner, device_id):
                self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id
        class P:
            def __init__(self, mem, off):
                self.mem, self.ptr = mem, mem.ptr + off
        a = dmem._dmem.CupyAllocator(U, P, lambda: 0, lambda: 0, lambda: None)
        p = a(3000)
        rt = dmem.default_runtime()
        assert p.mem.owner.runtime is rt and rt.stats()["raw_used"] == 3000
        del p
        assert rt.stats()["raw_used"] == 0
    """)


def test_cupy_allocator_is_cheap(rt):
    # The C path against a same-run baseline: the Python code that does the
    # least any allocator of this shape must (call the two getters, build
    # the UnownedMemory and MemoryPointer stand-ins and an owner, drop them),
    # with no allocation at all. The C path does that work plus dmem's raw
    # alloc and free, and must not cost more than twice the baseline
    # (measured on the 2-core CI-class machine under load: 0.77-1.22x; a
    # path doing three times the work measured 4.8x and failed).
    import time

    alloc = fake_allocator(rt)
    get_device, get_stream = (lambda: 0), (lambda: 0)

    def python_baseline(nbytes):
        get_device()
        get_stream()
        owner = object()
        return FakePointer(FakeUnowned(4096, nbytes, owner, 0), 0)

    def best_of(fn):
        best = 1.0
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(20000):
                fn(256)
            best = min(best, (time.perf_counter() - t) / 20000)
        return best

    # interleaved, so that a busy moment hits both; a loaded machine (other
    # test processes on 2 cores) can still slow one side through a whole
    # round: up to 3 rounds, the best ratio counts (a path 2x too slow
    # fails every round)
    for _ in range(3):
        c_path, baseline = [], []
        for _ in range(3):
            c_path.append(best_of(alloc))
            baseline.append(best_of(python_baseline))
        c, b = min(c_path), min(baseline)
        if c < 2.0 * b:
            break
    print(f"CupyAllocator alloc+free with Python stand-ins: {c * 1e9:.0f} ns; "
          f"the same objects built in Python, no allocation: {b * 1e9:.0f} ns ({c / b:.2f}x)")
    assert c < 2.0 * b, f"C path {c * 1e9:.0f} ns, Python baseline {b * 1e9:.0f} ns"


# ---- the Numba EMM plugin over a stand-in numba package ----------------------------------------

FAKE_NUMBA = {
    "numba/__init__.py": "",
    "numba/cuda/__init__.py": '''
import contextlib, weakref
from .cudadrv import driver
from .cudadrv.driver import HostOnlyCUDAMemoryManager, MemoryPointer, IpcHandle
def set_memory_manager(cls):
    dummy = cls(context=None)
    assert dummy.interface_version == 1
    driver._memory_manager = cls
''',
    "numba/cuda/cudadrv/__init__.py": "",
    "numba/cuda/cudadrv/driver.py": '''
import contextlib, weakref
from collections import namedtuple
MemoryInfo = namedtuple("MemoryInfo", "free,total")
_memory_manager = None
class config:
    CUDA_PER_THREAD_DEFAULT_STREAM = 0
class binding:
    class CUdeviceptr(int):
        pass
    class CUipcMemHandle:
        reserved = b""
class HostOnlyCUDAMemoryManager:
    def __init__(self, *args, **kwargs):
        self.context = kwargs.pop("context")
        self.host_resets = 0
        self.host_deferred = 0
    def initialize(self):
        pass
    def reset(self):
        self.host_resets += 1
    @contextlib.contextmanager
    def defer_cleanup(self):
        self.host_deferred += 1
        try:
            yield
        finally:
            self.host_deferred -= 1
class MemoryPointer:
    def __init__(self, context, pointer, size, owner=None, finalizer=None):
        self.context, self.device_pointer, self.size = context, pointer, size
        self.handle = pointer
        if finalizer is not None:
            self._finalizer = weakref.finalize(self, finalizer)
    @property
    def device_pointer_value(self):
        return int(self.device_pointer) or None
class IpcHandle:
    def __init__(self, base, handle, size, source_info=None, offset=0):
        self.base, self.handle, self.size, self.source_info, self.offset = (
            base, handle, size, source_info, offset)
''',
}


@pytest.fixture
def fake_numba(tmp_path):
    import importlib.util
    if importlib.util.find_spec("numba") is not None:
        # numba-cuda hooks the real package's import machinery, which the
        # stand-in would shadow; there test_integrations_gpu.py uses the
        # real one instead.
        pytest.skip("the real numba is installed: the stand-in is for machines without it")
    for rel, text in FAKE_NUMBA.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(dmem.__file__)))
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), pkg_parent,
                                           os.environ.get("PYTHONPATH", "")])}


@pytest.mark.parametrize("pointer", ["finalize", "del"])
def test_numba_manager_over_stand_in(fake_numba, pointer):
    check("""
        import gc, dmem, dmem.numba
        from numba import cuda
        from numba.cuda.cudadrv import driver
        M = dmem.numba.DmemNumbaManager
        assert M is dmem.numba._numba_memory_manager
        assert issubclass(M, cuda.HostOnlyCUDAMemoryManager) and M.__module__ == "dmem.numba"
        dmem.numba.use_dmem_for_numba()
        assert driver._memory_manager is M
        class Device:
            id = 0
            def get_device_identity(self):
                return {"uuid": "x"}
        class Context:
            device = Device()
        ctx = Context()
        mm = M(context=ctx)
        assert mm.interface_version == 1
        mm.initialize()
        mm.initialize()                                  # again: harmless
        rt = dmem.default_runtime(0)
        p = mm.memalloc(1000)
        assert isinstance(p.device_pointer, driver.binding.CUdeviceptr)
        assert int(p.device_pointer) % 256 == 0 and p.size == 1000 and p.context is ctx
        assert rt.stats()["raw_used"] == 1000
        info = mm.get_memory_info()
        assert isinstance(info, driver.MemoryInfo)
        assert tuple(info) == rt.memory_info() and info.total == rt.stats()["device_limit"]
        del p
        gc.collect()
        assert rt.stats()["raw_used"] == 0               # the finalizer freed it
        z = mm.memalloc(0)
        assert int(z.device_pointer) == 0
        # defer_cleanup: frees wait for the end of the outermost block
        with mm.defer_cleanup():
            assert mm.host_deferred == 1                 # super() deferred host cleanup too
            a = mm.memalloc(4096)
            with mm.defer_cleanup():
                b = mm.memalloc(4096)
                del b
            del a
            gc.collect()
            assert rt.stats()["raw_used"] == 8192
        assert rt.stats()["raw_used"] == 0 and mm.host_deferred == 0
        # reset frees this context's raw allocations, not spillable buffers
        buf = rt.alloc(1 << 16)
        buf.write(b"k" * (1 << 16))
        keep = [mm.memalloc(1 << 12) for _ in range(5)]
        other = M(context=ctx)
        theirs = other.memalloc(1 << 12)
        assert rt.stats()["raw_used"] == 6 << 12
        mm.reset()
        assert mm.host_resets == 1
        assert rt.stats()["raw_used"] == 1 << 12
        assert buf.read() == b"k" * (1 << 16) and buf.state == "resident"
        fresh = mm.memalloc(1 << 12)                     # may reuse a freed address
        del keep                                         # stale finalizers: no double free
        gc.collect()
        assert rt.stats()["raw_used"] == 2 << 12
        del fresh, theirs
        gc.collect()
        assert rt.stats()["raw_used"] == 0
        try:
            mm.get_ipc_handle(mm.memalloc(64))
        except dmem.NoDeviceError:                       # host backend
            pass
        else:
            raise AssertionError
        dummy = M(context=None)                          # set_memory_manager's probe
        assert dummy.interface_version == 1
        print("ok")
    """, env=dict(fake_numba, DMEM_NUMBA_POINTER=pointer))


def test_numba_pointer_freed_by_del(fake_numba):
    # DMEM_NUMBA_POINTER=del: the pointer is freed by free() (once: again is
    # Numba's "Freeing dead memory") or by collection; pointers alive at exit
    # are left to the process's end, and the interpreter exits at once.
    out = check("""
        import gc, dmem, dmem.numba
        from numba.cuda.cudadrv import driver
        class Device:
            id = 0
        class Context:
            device = Device()
        mm = dmem.numba.DmemNumbaManager(context=Context())
        mm.initialize()
        rt = dmem.default_runtime(0)
        q = mm.memalloc(64)
        assert type(q).__name__ == "DmemMemoryPointer"
        assert isinstance(q, driver.MemoryPointer) and q.is_managed and q.refct == 1
        assert q.size == 64 and q._cuda_memsize_ == 64 and q.handle is q.device_pointer
        assert rt.stats()["raw_used"] == 64
        q.free()
        assert rt.stats()["raw_used"] == 0
        try:
            q.free()
        except RuntimeError:
            pass
        else:
            raise AssertionError("double free accepted")
        del q
        r = mm.memalloc(128)
        del r                                            # collected: given back
        assert rt.stats()["raw_used"] == 0
        with mm.defer_cleanup():
            t = mm.memalloc(256)
            del t
            assert rt.stats()["raw_used"] == 256         # held back
        assert rt.stats()["raw_used"] == 0
        keep = [mm.memalloc(1 << 12) for _ in range(100)]   # alive at exit
        print("ok")
    """, env=dict(fake_numba, DMEM_NUMBA_POINTER="del"), timeout=60)
    assert "ok" in out


def test_numba_manager_reports_out_of_memory(fake_numba):
    check("""
        import dmem, dmem.numba
        dmem.configure(device_limit="1MiB")
        class Device:
            id = 0
        class Context:
            device = Device()
        mm = dmem.numba.DmemNumbaManager(context=Context())
        try:
            mm.memalloc(2 << 20)
        except MemoryError as e:
            assert isinstance(e, dmem.OutOfMemoryError)
        else:
            raise AssertionError
    """, env=fake_numba)


def test_numba_device_ordinal_of_attached_context():
    # numba-cuda's Device has .id; a context attached to another library's
    # primary context carries the driver's CUdevice (int() is the ordinal).
    import dmem.numba

    class Dev:
        id = 3

    class CUdevice:
        def __int__(self):
            return 2

    class Ctx:
        def __init__(self, device):
            self.device = device

    assert dmem.numba._device_ordinal(None) is None
    assert dmem.numba._device_ordinal(Ctx(Dev())) == 3
    assert dmem.numba._device_ordinal(Ctx(CUdevice())) == 2
