"""The hooks of issue 24 without a GPU (host backend): dmem.rmm,
dmem.cuda_core, dmem.numba's routing of numba-cuda's kernel-argument copies
and dmem.torch.mempool. What needs the libraries themselves on a device is
in test_integrations_gpu.py; here: imports without the libraries, typed
errors for bad arguments and for a missing, mismatched or foreign RMM, the
native attach's checks (dmem._rmm, when built), and dmem.cuda_core's
resource and numba-cuda's routing over stand-in packages.

Each test runs in a fresh interpreter (run_python): the stand-ins and the
default runtime are per process."""

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


def stand_ins(tmp_path, files):
    """Write a stand-in package tree; the environment that puts it first."""
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(dmem.__file__)))
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), pkg_parent,
                                           os.environ.get("PYTHONPATH", "")])}


def have_native_rmm():
    import importlib.util
    return importlib.util.find_spec("dmem._rmm") is not None


# ---- imports without the libraries ------------------------------------------------------

def test_modules_import_without_rmm_cuda_core_torch():
    out = check("""
        import sys
        for name in ("rmm", "cuda", "cuda.core", "torch", "numba"):
            sys.modules[name] = None          # as if not installed
        import dmem, dmem.rmm, dmem.cuda_core, dmem.torch, dmem.numba
        assert not [m for m in ("rmm.mr", "cuda.core", "torch.cuda") if sys.modules.get(m)]
        for what, f, pkg in [
                ("use_dmem_for_rmm", dmem.rmm.use_dmem_for_rmm, "RMM"),
                ("DmemMemoryResource", lambda: dmem.rmm.DmemMemoryResource, "RMM"),
                ("cuda_core.MemoryResource", lambda: dmem.cuda_core.MemoryResource, "cuda.core"),
                ("torch.mempool", dmem.torch.mempool, "PyTorch")]:
            try:
                f()
            except ImportError as e:
                assert pkg in str(e), (what, str(e))
            else:
                raise AssertionError(what + " did not raise ImportError")
        for mod in (dmem.rmm, dmem.cuda_core):
            try:
                mod.no_such_name
            except AttributeError:
                pass
            else:
                raise AssertionError(mod)
        assert dmem.numba.kernel_arg_copies() == {}
        print("ok")
    """)
    assert "ok" in out


def test_import_creates_no_runtime():
    check("""
        import dmem, dmem.rmm, dmem.cuda_core, dmem.torch
        dmem.configure(device_limit="1MiB")
        assert dmem.default_runtime().stats()["device_limit"] == 1 << 20
    """)


# ---- dmem.rmm over a stand-in rmm ----------------------------------------------------------

def fake_rmm(version):
    return {
        "rmm/__init__.py": f"__version__ = {version!r}\nfrom . import mr\n",
        "rmm/mr.py": '''
            class DeviceMemoryResource:        # not RMM's Cython class
                pass
            _mrs = {}
            def get_per_device_resource(d):
                return _mrs.get(d)
            def set_per_device_resource(d, mr):
                _mrs[d] = mr
        ''',
        "rmm/_cuda/__init__.py": "",
        "rmm/_cuda/gpu.py": "def getDevice():\n    return 0\n",
    }


def test_rmm_without_native_module_says_how_to_build(tmp_path):
    env = stand_ins(tmp_path, fake_rmm("26.10.00"))
    check("""
        import sys
        sys.modules["dmem._rmm"] = None       # a dmem built without RMM's headers
        import dmem.rmm
        for f in (dmem.rmm.use_dmem_for_rmm, lambda: dmem.rmm.DmemMemoryResource,
                  lambda: dmem.rmm.forget_stream(5)):
            try:
                f()
            except ImportError as e:
                assert "without RMM's headers" in str(e) and "DMEM_RMM_ROOT" in str(e), str(e)
            else:
                raise AssertionError("no ImportError")
    """, env=env)


@pytest.mark.skipif(not have_native_rmm(), reason="dmem._rmm not built (no RMM headers)")
def test_rmm_version_mismatch_is_a_runtime_error(tmp_path):
    env = stand_ins(tmp_path, fake_rmm("25.02.00"))
    check("""
        import dmem.rmm, dmem._rmm
        try:
            dmem.rmm.use_dmem_for_rmm()
        except RuntimeError as e:
            assert "25.02.00" in str(e) and dmem._rmm.RMM_VERSION in str(e), str(e)
        else:
            raise AssertionError("no RuntimeError")
    """, env=env)


@pytest.mark.skipif(not have_native_rmm(), reason="dmem._rmm not built (no RMM headers)")
def test_rmm_foreign_layout_and_bad_devices_are_refused(tmp_path):
    import dmem._rmm as native
    env = stand_ins(tmp_path, fake_rmm(f"{native.RMM_VERSION_MAJOR}.{native.RMM_VERSION_MINOR:02d}.00"))
    check("""
        import rmm.mr, dmem, dmem.rmm, dmem._rmm as native
        cls = dmem.rmm.DmemMemoryResource
        assert issubclass(cls, rmm.mr.DeviceMemoryResource)
        for bad, exc in [(-1, ValueError), ("0", TypeError), (True, TypeError), (1.0, TypeError)]:
            try:
                cls(bad)
            except exc:
                pass
            else:
                raise AssertionError(repr(bad))
        # a DeviceMemoryResource that is not RMM's Cython class: refused, never written to
        try:
            dmem.rmm.use_dmem_for_rmm()
        except RuntimeError as e:
            assert "not the RMM this dmem was built for" in str(e), str(e)
        else:
            raise AssertionError("no RuntimeError")
        assert rmm.mr.get_per_device_resource(0) is None   # nothing was set
        # the native checks, directly
        class B:
            pass
        for args, exc in [((B(), 1, 0), TypeError), ((1, B, 0), TypeError),
                          ((B(), B, 0), RuntimeError), ((B(), B), TypeError)]:
            try:
                native.attach(*args)
            except exc:
                pass
            else:
                raise AssertionError(args)
        why = native.layout_ok(B(), B)
        assert isinstance(why, str) and "size" in why, why
        # forget_stream: typed errors; a device RMM never used through dmem: nothing
        class CupyLike:
            ptr = 12345
        for bad, exc in [(True, TypeError), (-3, ValueError), (object(), TypeError),
                         (1.5, TypeError)]:
            try:
                dmem.rmm.forget_stream(bad, device=0)
            except exc:
                pass
            else:
                raise AssertionError(repr(bad))
        for bad, exc in [((-1, 5), ValueError), ((64, 5), ValueError), ((0, -5), OverflowError)]:
            try:
                native.forget_stream(*bad)
            except exc:
                pass
            else:
                raise AssertionError(bad)
        assert dmem.rmm.forget_stream(CupyLike(), device=0) is None
        assert dmem.rmm.forget_stream(0) is None           # the default stream
        print("ok")
    """, env=env)


# ---- dmem.cuda_core over a stand-in cuda.core ---------------------------------------------

FAKE_CUDA_CORE = {
    "cuda/__init__.py": "",
    "cuda/core/__init__.py": '''
        class Stream:
            def __init__(self, handle):
                self.handle = handle
                self.synced = 0
            def __cuda_stream__(self):
                return (0, self.handle)
            def sync(self):
                self.synced += 1
        class GraphBuilder:
            pass
        class MemoryResource:
            pass
        class Buffer:
            closed = []
            @classmethod
            def from_handle(cls, ptr, size, mr=None, owner=None, *, stream=None):
                b = cls()
                b.handle, b.size, b.memory_resource, b.stream = ptr, size, mr, stream
                return b
            def close(self, stream=None):
                self.memory_resource.deallocate(self.handle, self.size, stream=stream or self.stream)
        class Device:
            def __init__(self, device_id=None):
                self.device_id = 0 if device_id is None else device_id
    ''',
}


def test_cuda_core_resource_over_stand_in(tmp_path):
    env = stand_ins(tmp_path, FAKE_CUDA_CORE)
    check("""
        import cuda.core as cc, dmem, dmem.cuda_core
        MR = dmem.cuda_core.MemoryResource
        assert MR is dmem.cuda_core.MemoryResource and issubclass(MR, cc.MemoryResource)
        mr = MR()                                   # cuda.core's current device: 0
        assert mr.device_id == 0 and mr.runtime is dmem.default_runtime(0)
        assert mr.is_device_accessible and not mr.is_host_accessible and not mr.is_managed
        assert MR(cc.Device(0)).device_id == 0
        rt = mr.runtime
        b = mr.allocate(1 << 20)                    # keyword or positional stream: both
        assert isinstance(b, cc.Buffer) and b.size == 1 << 20 and b.memory_resource is mr
        assert b.handle % 256 == 0 and rt.stats()["raw_used"] == 1 << 20
        c = mr.allocate(4096, None)
        d = mr.allocate(4096, stream=0)             # numba-cuda passes 0 for the default
        assert rt.stats()["raw_used"] == (1 << 20) + 8192
        b.close()
        c.close()
        mr.deallocate(d.handle, 4096, stream=None)
        assert rt.stats()["raw_used"] == 0
        z = mr.allocate(0)
        assert z.handle == 0 and z.size == 0
        mr.deallocate(0, 0)                         # a zero-size buffer's close: nothing
        # bad arguments: typed errors, nothing allocated or freed
        for args, exc in [((-1,), ValueError), ((1.5,), TypeError), ((True,), TypeError)]:
            try:
                mr.allocate(*args)
            except exc:
                pass
            else:
                raise AssertionError(args)
        e = mr.allocate(512)
        for bad in (e.handle + 256, 12345):
            try:
                mr.deallocate(bad, 512)
            except ValueError:
                pass
            else:
                raise AssertionError(bad)
        assert rt.stats()["raw_used"] == 512
        e.close()
        try:
            e.close()                               # twice: refused, not a double free
        except ValueError:
            pass
        else:
            raise AssertionError("double deallocate")
        assert rt.stats()["raw_used"] == 0
        # a foreign stream on the host backend: dmem's typed error
        try:
            mr.allocate(64, cc.Stream(1234))
        except TypeError as e:
            assert "host backend" in str(e), str(e)
        else:
            raise AssertionError("host backend took a foreign stream")
        assert rt.stats()["raw_used"] == 0
        # freed on another stream than its own: that stream is waited for
        # first; when the wait fails, the buffer stays allocated
        f = mr.allocate(512)
        try:
            mr.deallocate(f.handle, 512, stream=cc.Stream(99))
        except TypeError:
            pass
        else:
            raise AssertionError("waited for a foreign stream on the host backend")
        assert rt.stats()["raw_used"] == 512
        mr.deallocate(f.handle, 512)
        assert rt.stats()["raw_used"] == 0
        for bad, exc in [(-2, ValueError), ("x", TypeError)]:
            try:
                MR(bad)
            except exc:
                pass
            else:
                raise AssertionError(bad)
        # out of memory: dmem's MemoryError, nothing counted
        try:
            mr.allocate(1 << 40)
        except dmem.OutOfMemoryError:
            pass
        else:
            raise AssertionError("no OutOfMemoryError")
        assert rt.stats()["raw_used"] == 0
        print("ok")
    """, env=env)


# ---- numba-cuda's kernel-argument copies, over stand-ins ---------------------------------

FAKE_NUMBA = {
    "numba/__init__.py": "",
    "numba/cuda/__init__.py": '''
        from .cudadrv import driver
        from .cudadrv.driver import HostOnlyCUDAMemoryManager, MemoryPointer, IpcHandle
        def set_memory_manager(cls):
            driver._memory_manager = cls
    ''',
    "numba/cuda/cudadrv/__init__.py": "",
    "numba/cuda/cudadrv/driver.py": '''
        from collections import namedtuple
        MemoryInfo = namedtuple("MemoryInfo", "free,total")
        class binding:
            class CUdeviceptr(int):
                pass
        class HostOnlyCUDAMemoryManager:
            def __init__(self, *args, **kwargs):
                self.context = kwargs.pop("context")
            def initialize(self):
                pass
        class MemoryPointer:
            def __init__(self, context, pointer, size, owner=None, finalizer=None):
                self.context, self.device_pointer, self.size = context, pointer, size
        class IpcHandle:
            pass
    ''',
}


def test_numba_routes_kernel_argument_copies_through_cuda_core(tmp_path):
    import importlib.util
    if importlib.util.find_spec("numba") is not None:
        pytest.skip("the real numba is installed: the stand-in is for machines without it")
    env = stand_ins(tmp_path, dict(FAKE_NUMBA, **FAKE_CUDA_CORE))
    check("""
        import cuda.core as cc, dmem, dmem.numba, dmem.cuda_core
        M = dmem.numba.DmemNumbaManager
        class Device:                               # numba-cuda >= 0.25: a cuda.core Device inside
            id = 1
            def __init__(self):
                self._dev = cc.Device(1)
                self._dev.memory_resource = cc.MemoryResource()   # cuda.core's own
        class OldDevice:                            # older numba-cuda: no cuda.core Device
            id = 2
        class Context:
            def __init__(self, dev):
                self.device = dev
        new, old = Context(Device()), Context(OldDevice())
        M(context=new).initialize()
        M(context=old).initialize()
        mr = new.device._dev.memory_resource
        assert isinstance(mr, dmem.cuda_core.MemoryResource) and mr.device_id == 1, mr
        routes = dmem.numba.kernel_arg_copies()
        assert routes[1] == "dmem", routes
        assert routes[2].startswith("not routed") and "memalloc" in routes[2], routes
        # what numba-cuda does for a host array argument: Device.allocate(n, stream)
        rt = dmem.default_runtime(1)
        buf = mr.allocate(3000, 0)
        assert rt.stats()["raw_used"] == 3000
        buf.close()
        assert rt.stats()["raw_used"] == 0
        print("ok")
    """, env=env)


def test_numba_without_cuda_core_is_a_no_op_with_a_reason(tmp_path):
    import importlib.util
    if importlib.util.find_spec("numba") is not None:
        pytest.skip("the real numba is installed: the stand-in is for machines without it")
    env = stand_ins(tmp_path, FAKE_NUMBA)
    check("""
        import sys
        sys.modules["cuda"] = sys.modules["cuda.core"] = None
        import dmem.numba
        class Core:
            memory_resource = "cuda.core's own"
        class Device:
            id = 0
            _dev = Core()
        class Context:
            device = Device()
        ctx = Context()
        dmem.numba.DmemNumbaManager(context=ctx).initialize()
        assert ctx.device._dev.memory_resource == "cuda.core's own"
        why = dmem.numba.kernel_arg_copies()[0]
        assert why.startswith("not routed") and "cuda.core" in why, why
        print("ok")
    """, env=env)


# ---- dmem.torch.mempool's arguments ---------------------------------------------------------

FAKE_TORCH = {
    "torch/__init__.py": '''
        __version__ = "2.9.0+stand-in"
        from . import cuda
        class device:
            def __init__(self, kind, index=None):
                if isinstance(kind, device):
                    kind, index = kind.type, kind.index
                elif ":" in str(kind):
                    kind, index = str(kind).split(":")
                    index = int(index)
                self.type, self.index = kind, index
    ''',
    "torch/cuda/__init__.py": '''
        import contextlib
        from . import memory
        current = [1]
        made = []
        def current_device():
            return current[0]
        @contextlib.contextmanager
        def device(d):
            old, current[0] = current[0], d
            try:
                yield
            finally:
                current[0] = old
        class MemPool:
            def __init__(self, allocator=None):
                self.allocator, self.device = allocator, current[0]
                made.append(self)
    ''',
    "torch/cuda/memory.py": '''
        class CUDAPluggableAllocator:
            def __init__(self, path, alloc, free):
                self.args = (path, alloc, free)
            def allocator(self):
                return ("pluggable", self.args)
    ''',
}


def test_torch_mempool_over_stand_in(tmp_path):
    import importlib.util
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("PyTorch is installed: test_integrations_gpu.py tests mempool")
    env = stand_ins(tmp_path, FAKE_TORCH)
    check("""
        import torch, dmem.torch
        p = dmem.torch.mempool()                    # the current device (1 here)
        assert isinstance(p, torch.cuda.MemPool) and p.device == 1
        kind, (path, a, f) = p.allocator
        assert (kind, a, f) == ("pluggable", "dmem_torch_alloc", "dmem_torch_free")
        assert path == dmem.torch.library_path()
        q = dmem.torch.mempool("cuda:3")
        assert q.device == 3 and torch.cuda.current_device() == 1   # made on 3, then back
        assert dmem.torch.mempool(torch.device("cuda", 2)).device == 2
        assert dmem.torch.mempool(0).device == 0 and p is not q
        for bad in ("cpu", torch.device("cpu")):
            try:
                dmem.torch.mempool(bad)
            except ValueError:
                pass
            else:
                raise AssertionError(bad)
        n = len(torch.cuda.made)
        del torch.cuda.MemPool                      # PyTorch before 2.8
        try:
            dmem.torch.mempool(0)
        except RuntimeError as e:
            assert "2.8" in str(e), str(e)
        else:
            raise AssertionError("no RuntimeError without MemPool")
        assert len(torch.cuda.made) == n
        print("ok")
    """, env=env)

def test_torch_mempool_needs_torch_and_a_cuda_device():
    import importlib.util
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("PyTorch is installed: test_integrations_gpu.py tests mempool")
    check("""
        import dmem.torch
        try:
            dmem.torch.mempool(0)
        except ImportError as e:
            assert "PyTorch" in str(e), str(e)
        else:
            raise AssertionError("no ImportError")
    """)
