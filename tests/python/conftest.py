"""Shared fixtures: every test uses the host backend with a small simulated
device, so the tests run without a GPU (CTest sets PYTHONPATH to the build
tree's package)."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import dmem

# numba-cuda 0.30 still calls numpy.row_stack, which numpy 2.5 removed (see
# anchors.md); alias it so that Numba's JIT works in the GPU interop tests.
try:
    import numpy

    if not hasattr(numpy, "row_stack"):
        numpy.row_stack = numpy.vstack
except ImportError:
    pass

CAPACITY = 8 << 20  # simulated device memory of the host backend


_dask_tmp = None


def pytest_configure(config):
    """Dask's workers (in this process, spawned, or started as programs)
    make their dask-scratch-space under DASK_TEMPORARY_DIRECTORY, else under
    $TMPDIR: give them a folder of their own, removed at the end, so that a
    test run leaves nothing behind."""
    global _dask_tmp
    if "DASK_TEMPORARY_DIRECTORY" not in os.environ:
        import tempfile

        _dask_tmp = tempfile.mkdtemp(prefix="dmem-test-dask-")
        os.environ["DASK_TEMPORARY_DIRECTORY"] = _dask_tmp


def pytest_unconfigure(config):
    if _dask_tmp:
        shutil.rmtree(_dask_tmp, ignore_errors=True)


@pytest.fixture
def spill_dir(tmp_path):
    d = tmp_path / "spill"
    d.mkdir()
    return d


@pytest.fixture
def rt(spill_dir):
    r = dmem.Runtime(backend="host", host_capacity=CAPACITY, spill_dir=str(spill_dir))
    yield r
    r.close()


def run_python(code, timeout=120, env_extra=None):
    """Run code in a fresh interpreter with the same dmem on the path; return
    the CompletedProcess (stdout/stderr as text)."""
    env = dict(os.environ)
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(dmem.__file__)))
    env["PYTHONPATH"] = pkg_parent + os.pathsep + env.get("PYTHONPATH", "")
    if env_extra:
        env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def gpu_env():
    """The environment for a child process of a GPU test: this dmem on the
    path, and none of the variables that would pick the host backend, cap
    the device or choose Numba's memory manager."""
    e = dict(os.environ)
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(dmem.__file__)))
    e["PYTHONPATH"] = pkg_parent + os.pathsep + e.get("PYTHONPATH", "")
    for k in ("DMEM_BACKEND", "DMEM_DEVICE_LIMIT", "NUMBA_CUDA_MEMORY_MANAGER"):
        e.pop(k, None)
    return e
