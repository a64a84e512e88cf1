"""dmem.dask on a GPU (skipped without one, or without CuPy, dask and
distributed): the mapping with CuPy and Numba arrays (copies, adoption of
dmem.cupy allocations, exposure, spilling under pressure with the data
checked after every move, evict to disk, the dask and cuda serializer
families), and examples/dask_cupy.py on dmem.dask.LocalCluster at 3x the
device limit with exact results.

Run on the GPU machine: scripts/gpu-test (step python-integrations), or
PYTHONPATH=build/gpu/python python3 -m pytest -v tests/python/test_dask_gpu.py
"""

import os
import subprocess
import sys

import pytest

from conftest import gpu_env, run_python

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _ready():
    r = run_python("""
        import cupy, dask, distributed, dmem
        rt = dmem.Runtime(backend="cuda", device_limit=1 << 20)
        assert rt.backend == "cuda"
        assert cupy.cuda.runtime.getDeviceCount() > 0
    """, env_extra={"DMEM_BACKEND": ""})
    return r.returncode == 0, (r.stderr.strip().splitlines() or [""])[-1]


_ok, _why = _ready()
pytestmark = pytest.mark.skipif(not _ok, reason=f"no CUDA device, CuPy or dask for dmem: {_why}")


env = gpu_env


def run(code, timeout=300):
    r = run_python(code, timeout=timeout, env_extra={"DMEM_BACKEND": ""})
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


COMMON = """
import gc, tempfile, numpy as np, cupy, dmem
from dmem.dask import DmemWorkerData, DmemValue
from dmem.dask import data as ddata
from distributed.protocol import serialize, deserialize
MiB = 1 << 20

def chunk(i, n=1024):          # 8 MiB of float64, its own values
    a = cupy.arange(n * n, dtype=cupy.float64).reshape(n, n)
    return a * 0 + i + a % 97

def check(d, k, i):
    v = d[k]
    assert isinstance(v, cupy.ndarray), type(v)
    assert bool((v == chunk(i)).all()), (k, i)
    del v
"""


def test_mapping_copies_spills_and_verifies_cupy_and_numba_arrays(tmp_path):
    out = run(COMMON + f"""
rt = dmem.Runtime(backend="cuda", device_limit=64 * MiB, spill_dir={str(tmp_path)!r})
d = DmemWorkerData(runtime=rt, worker_local_directory={str(tmp_path)!r})
for i in range(24):                      # 192 MiB under 64: 3x the limit
    d[i] = chunk(i)
    if i % 5 == 0:
        d[("f", i)] = cupy.asfortranarray(chunk(i))
gc.collect()
s = rt.stats()
assert s["spill_count"] > 0 and s["device_used"] <= 64 * MiB, s
tiers = {{d.tier_of(i) for i in range(24)}}
assert "host" in tiers and "device" in tiers, tiers
for rnd in range(2):                     # every key back (unspilled) and checked
    for i in range(24):
        check(d, i, i)
assert d[("f", 5)].flags.f_contiguous
# a Numba device array goes in and comes out as a Numba array
from numba import cuda
na = cuda.to_device(np.arange(1000, dtype=np.float32))
d["numba"] = na
got = d["numba"]
assert type(got).__name__ == "DeviceNDArray", type(got)
assert (got.copy_to_host() == np.arange(1000, dtype=np.float32)).all()
del got
# exposure holds the buffer; evict moves host-tier keys to disk
a = d[0]
b0 = d._dev[0].leaves[0].buf
assert b0.exposed and b0.state == "resident"
del a; gc.collect()
assert not b0.exposed
n = 0
while d.fast and n < 100:
    assert d.evict() > 0; n += 1
assert n > 0 and any(d.tier_of(i) == "disk" for i in range(24))
for i in range(24):
    check(d, i, i)
# serialisation: a spilled value goes from host/disk without unspilling
for i in range(24):
    if d.tier_of(i) in ("host", "disk"):
        break
u0 = rt.stats()["unspill_count"]
tok = ddata.for_transfer.set(True)
v = d[i]
ddata.for_transfer.reset(tok)
assert isinstance(v, DmemValue)
for fam in ("dask", "cuda"):
    h, f = serialize(v, serializers=(fam,))
    assert rt.stats()["unspill_count"] == u0, fam
    got = deserialize(h, f)
    assert isinstance(got, cupy.ndarray) and bool((got == chunk(i)).all()), fam
# and a resident one through the cuda family as a device frame
check(d, 23, 23)
tok = ddata.for_transfer.set(True); v = d[23]; ddata.for_transfer.reset(tok)
h, f = serialize(v, serializers=("cuda",))
assert any(hasattr(x, "__cuda_array_interface__") for x in f)
assert bool((deserialize(h, f) == chunk(23)).all())
del v, h, f, got
d.close(); gc.collect(); rt.close()
print("copied", d.counts["copied"], "ok")
""")
    assert "ok" in out


def test_adoption_of_dmem_cupy_allocations():
    out = run(COMMON + """
dmem.configure(device_limit=256 * MiB)
import dmem.cupy
dmem.cupy.use_dmem_for_cupy()
d = DmemWorkerData(worker_local_directory=tempfile.gettempdir())
rt = d.runtime
assert rt.is_default
x = chunk(3)                      # allocated through dmem: a raw block
raw0 = rt.stats()["raw_used"]
d["x"] = x
assert d.counts["adopted"] == 1 and d.counts["copied"] == 0, d.counts
buf = d._dev["x"].leaves[0].buf
assert buf.lock_count == 1        # x still points at it
assert rt.stats()["raw_used"] < raw0
del x; gc.collect()
assert buf.lock_count == 0
buf.spill("host")
check(d, "x", 3)
d.close()
print("ok")
""")
    assert "ok" in out


def test_local_cluster_3x_the_device_limit_example():
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "dask_cupy.py"), "--cluster", "dmem",
         "--n", "12000", "--c", "1000", "--limit", "768MB", "--workers", "1",
         "--check-n", "3000", "--check-c", "500"],
        env=env(), capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "dask_cupy: OK" in r.stdout


def test_ipc_handle_is_opened_by_another_process_and_held_until_release(tmp_path):
    """Device arrays go as CUDA IPC handles, locked until the Transfer is
    released (a spilled one brought back to the device first); a NumPy one
    in the same value as bytes. Another process opens the handles and gets
    the exact bytes; this one may not."""
    path = str(tmp_path / "msg.pkl")
    child = COMMON + f"""
import pickle, dmem.dask
from dmem.dask import serialize as dser
h, f = pickle.load(open({path!r}, "rb"))
got = deserialize(h, f)
assert isinstance(got[0], cupy.ndarray) and isinstance(got[1], cupy.ndarray)
print("equal", bool((got[0] == chunk(1)).all()), bool((got[1] == chunk(2)).all()),
      bool((got[2] == np.arange(5)).all()))
print("received", dser.timing["ipc_received"], dser.timing["ipc_received_bytes"])
"""
    out = run(COMMON + f"""
import pickle, subprocess, sys
from dmem.dask import ipc, serialize as dser
from dmem.dask.ipc import Transfer
rt = dmem.Runtime(backend="cuda", device_limit=64 * MiB, spill_dir={str(tmp_path)!r})
d = DmemWorkerData(runtime=rt, worker_local_directory={str(tmp_path)!r})
d["k"] = (chunk(1), chunk(2), np.arange(5))
b1, b2 = (leaf.buf for leaf in d._dev["k"].leaves)
b2.spill("host")
t = Transfer(ipc=True)
tok = ddata.for_transfer.set(t); v = d["k"]; ddata.for_transfer.reset(tok)
h, f = serialize(v, serializers=("dask",), on_error="raise")
sub = h["sub-header"]                        # what dmem.dask.serialize wrote
print("ipc", sub.get("ipc"), "last error", ipc.last_error)
assert sub["ipc"][0] is not None and sub["ipc"][1] is not None, sub.get("ipc")
assert len(f[0]) == 0 and len(f[1]) == 0
assert dser.timing["ipc_sent"] == 2 and dser.timing["from_deferred_host"] == 1
assert b1.exposed and b2.exposed and b2.state == "resident" and t.held == 2
try:
    deserialize(h, f)
    raise AssertionError("opened its own handle")
except RuntimeError as e:
    assert "came back" in str(e), e
pickle.dump((h, [bytes(x) for x in f]), open({path!r}, "wb"))
r = subprocess.run([sys.executable, "-c", {child!r}], capture_output=True, text=True,
                   timeout=120)
print(r.stdout, r.stderr[-3000:])
assert r.returncode == 0
del v, h, f
gc.collect()
assert b1.exposed and b2.exposed             # until the receiver said OK
t.release(); gc.collect()
assert not b1.exposed and not b2.exposed
b1.spill("host")                             # spillable again, bytes intact
b2.spill("host")
got = d["k"]
assert bool((got[0] == chunk(1)).all()) and bool((got[1] == chunk(2)).all())
del got
d.close(); gc.collect(); rt.close()
print("ok")
""")
    assert "equal True True True" in out, out
    assert f"received 2 {16 << 20}" in out, out
    assert "ok" in out


def test_two_workers_send_arrays_by_ipc():
    """dmem.dask.LocalCluster with two worker processes, on GPUs 0 and 1 when
    two are visible (peer to peer), else both on GPU 0: a task on one worker
    reads arrays made on the other, resident and spilled ones, by IPC, with
    exact results; the client gets bytes."""
    out = run("""
import cupy, numpy as np, dmem.dask
from distributed import Client, wait
from dmem.dask import LocalCluster

def make(i):
    import cupy
    n = 1024
    a = cupy.arange(n * n, dtype=cupy.float64).reshape(n, n)
    return a * 0 + i + a % 97

def total(*xs):
    return float(sum(float(x.sum()) for x in xs))

def counters():
    from dmem.dask import serialize
    return dict(serialize.timing)

devices = [0, 1] if cupy.cuda.runtime.getDeviceCount() >= 2 else [0]
print("devices", devices)
with LocalCluster(n_workers=2, devices=devices, device_memory_limit="96MB",
                  threads_per_worker=1, dashboard_address=None) as cl, Client(cl) as c:
    wa, wb = sorted(c.scheduler_info()["workers"])
    parts = [c.submit(make, i, workers=[wa], pure=False) for i in range(20)]  # 160 MiB on A
    wait(parts)
    use = [0, 1, 2, 3, 16, 17, 18, 19]       # spilled on A (least recently used), resident
    s = c.submit(total, *[parts[i] for i in use], workers=[wb]).result()
    a = np.arange(1024 * 1024, dtype=np.float64).reshape(1024, 1024)
    want = sum(float((a * 0 + i + a % 97).sum()) for i in use)
    assert s == want, (s, want)
    got = c.gather(parts[3])                 # the client: bytes
    assert bool((got == make(3)).all())
    k = c.run(counters)
    print("A", {n: v for n, v in k[wa].items() if n.startswith(("ipc", "from"))})
    print("B", {n: v for n, v in k[wb].items() if n.startswith(("ipc", "from"))})
    assert k[wa]["ipc_sent"] == len(use) and k[wb]["ipc_received"] == len(use), k
    assert k[wa]["from_deferred_host"] + k[wa].get("from_deferred_disk", 0) >= 1, k[wa]
    assert k[wb]["ipc_received_bytes"] == k[wb]["ipc_received"] * 8 * (1 << 20)
print("ok")
""", timeout=300)
    print(out)
    assert "ok" in out
