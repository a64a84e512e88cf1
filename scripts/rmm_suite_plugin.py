"""pytest plugin of scripts/rmm-suite: RMM's own tests with dmem as RMM's
current device resource. Loaded with ``-p rmm_suite_plugin`` (scripts/ on
PYTHONPATH). Before every test (RMM's conftest puts RMM's default resource
back after each one, with rmm.reinitialize()) it makes
dmem.rmm.DmemMemoryResource the current device's resource, so each test
that uses the current resource (DeviceBuffer, rmm_cupy_allocator,
adaptors over get_current_device_resource()) allocates from dmem. Tests
that build their own resources over CudaMemoryResource keep them."""

import pytest


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
