"""pytest plugin of scripts/rmm-suite: RMM's own tests with dmem as RMM's
current device resource. Loaded with ``-p rmm_suite_plugin`` (scripts/ on
PYTHONPATH). Before every test (RMM's conftest puts RMM's default resource
back after each one, with rmm.reinitialize()) it makes
dmem.rmm.DmemMemoryResource the current device's resource, so each test
that uses the current resource (DeviceBuffer, rmm_cupy_allocator,
adaptors over get_current_device_resource()) allocates from dmem. Tests
that build their own resources over CudaMemoryResource keep them; so that
dmem's pool does not hold device memory they need, its empty slabs are
given back after every test (dmem_device_trim, through ctypes)."""

import ctypes

import pytest

_trim = None


def _trim_dmem_pool():
    """dmem_device_trim(default runtime of device 0, 0, NULL)."""
    global _trim
    if _trim is None:
        import dmem

        lib = ctypes.CDLL(dmem._dmem._library_path())
        rt = ctypes.c_void_p()
        if lib.dmem_runtime_default(0, ctypes.byref(rt)) != 0:
            raise RuntimeError("dmem_runtime_default(0) failed")
        lib.dmem_device_trim.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _trim = (lib.dmem_device_trim, rt)
    fn, rt = _trim
    fn(rt, 0, None)


def pytest_configure(config):
    import dmem.rmm

    dmem.rmm.use_dmem_for_rmm()  # fails the session at once if dmem.rmm cannot work


def pytest_report_header(config):
    import dmem

    s = dmem.default_runtime().stats()
    return (f"dmem: RMM's current device resource is dmem.rmm.DmemMemoryResource before every "
            f"test (device limit {s['device_limit']} bytes)")


@pytest.fixture(autouse=True)
def _dmem_is_rmm_current_resource():
    import rmm.mr

    import dmem.rmm

    mr = dmem.rmm.use_dmem_for_rmm()
    assert rmm.mr.get_current_device_resource() is mr
    yield
    _trim_dmem_pool()
