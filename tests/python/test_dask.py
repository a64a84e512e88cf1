"""dmem.dask.DmemWorkerData alone (host backend: NumPy arrays are the device
arrays): set/get/delete, exposure lifetime, spilling by key, evict() and
fast (distributed's ManualEvictProto), serialisation without unspilling, bad
values. The cluster tests are in test_dask_cluster.py."""

import gc
import pickle

import numpy as np
import pytest

import dmem

pytest.importorskip("distributed")
from distributed.protocol import deserialize, serialize  # noqa: E402

import dmem.arrays  # noqa: E402
import dmem.dask  # noqa: E402
from dmem.dask import DmemValue, DmemWorkerData  # noqa: E402
from dmem.dask import data as ddata  # noqa: E402
from dmem.dask import serialize as dser  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20


@pytest.fixture
def d(tmp_path):
    rt = dmem.Runtime(backend="host", host_capacity=8 * MiB, device_limit=4 * MiB,
                      spill_dir=str(tmp_path))
    m = DmemWorkerData(runtime=rt, worker_local_directory=str(tmp_path / "local"))
    yield m
    m.close()
    gc.collect()
    rt.close()


def chunk(i, shape=(256, 256)):
    """512 KiB of float64 whose every element tells which chunk it is."""
    return np.full(shape, float(i)) + np.arange(shape[1]) * 1e-3


def test_set_get_delete_round_trip(d):
    values = {
        "c": chunk(1),
        "f": np.asfortranarray(chunk(2)),
        "strided": chunk(3)[::2, 1::3],  # not contiguous: stored contiguous
        "int8": np.arange(1000, dtype=np.int8),
        "0d": np.array(7.5),
        "struct": np.array([(1, 2.0), (3, 4.0)], dtype=[("a", "i4"), ("b", "f8")]),
    }
    for k, v in values.items():
        d[k] = v
    assert len(d) == len(values) and set(d) == set(values)
    for k, v in values.items():
        got = d[k]
        assert type(got) is np.ndarray
        assert got.dtype == v.dtype and got.shape == v.shape
        np.testing.assert_array_equal(got, v)
        assert d.tier_of(k) in ("device", "host")
    assert d["f"].flags.f_contiguous
    assert d.runtime.stats()["buffer_count"] == len(values)
    del d["c"]
    assert "c" not in d and len(d) == len(values) - 1
    with pytest.raises(KeyError):
        d["c"]
    with pytest.raises(KeyError):
        del d["c"]
    gc.collect()
    assert d.runtime.stats()["buffer_count"] == len(values) - 1


def test_containers_and_host_values(d):
    obj = np.array([object(), 1], dtype=object)
    d["tree"] = (chunk(1), "label", {"x": chunk(2), "n": 3}, [chunk(3)])
    d["bytes"] = b"host value"
    d["obj"] = obj
    d["empty"] = np.zeros(0)
    t = d["tree"]
    assert isinstance(t, tuple) and t[1] == "label" and t[2]["n"] == 3
    np.testing.assert_array_equal(t[2]["x"], chunk(2))
    np.testing.assert_array_equal(t[3][0], chunk(3))
    assert d.tier_of("tree") == "device"
    # not device arrays: the SpillBuffer keeps them, as a plain worker would
    assert d.tier_of("bytes") == "host-value" and d["bytes"] == b"host value"
    assert d.tier_of("obj") == "host-value" and d["obj"] is obj
    assert d.tier_of("empty") == "host-value"
    assert d.runtime.stats()["buffer_count"] == 3


def test_replacing_a_key_frees_its_buffers(d):
    d["k"] = chunk(1)
    d["k"] = chunk(2)
    np.testing.assert_array_equal(d["k"], chunk(2))
    gc.collect()
    assert d.runtime.stats()["buffer_count"] == 1
    d["k"] = b"now a host value"
    assert d.runtime.stats()["buffer_count"] == 0 and d["k"] == b"now a host value"


def test_exposed_array_keeps_its_buffer_locked(d):
    d["k"] = chunk(5)
    buf = d._dev["k"].leaves[0].buf
    a = d["k"]
    view = a[10:20, ::2]  # a view of the array holds it too
    del a
    gc.collect()
    assert buf.exposed and buf.lock_count == 1
    with pytest.raises(dmem.BusyError):
        buf.spill("host")
    del view
    gc.collect()
    assert not buf.exposed and buf.lock_count == 0
    buf.spill("disk")
    np.testing.assert_array_equal(d["k"], chunk(5))  # unspilled on use


def test_delete_while_exposed_keeps_the_array_valid(d):
    d["k"] = chunk(6)
    a = d["k"]
    del d["k"]
    d["other"] = chunk(7)  # would reuse the block if it had been freed
    np.testing.assert_array_equal(a, chunk(6))
    del a
    gc.collect()
    assert d.runtime.stats()["buffer_count"] == 1


def test_pressure_spills_least_recently_used_keys(d):
    for i in range(7):  # 3.5 MiB of 4
        d[i] = chunk(i)
    for i in (0, 1, 2):
        d[i]  # now the most recently used
    gc.collect()
    d[7] = chunk(7)
    d[8] = chunk(8)  # 4.5 MiB: at least one key must go
    gc.collect()
    tiers = {i: d.tier_of(i) for i in range(9)}
    spilled = [i for i, t in tiers.items() if t != "device"]
    assert spilled and all(i in (3, 4, 5, 6) for i in spilled), tiers
    assert d.runtime.stats()["spill_count"] >= 1
    for i in range(9):
        np.testing.assert_array_equal(d[i], chunk(i))


def test_stored_keys_keep_to_device_memory_limit(tmp_path):
    """device_memory_limit bounds the stored keys' device bytes, as
    dask-cuda's device LRU does, not every byte of the runtime: memory a
    task still computes with (a raw block, here) does not push stored keys
    out, and the runtime's own (larger) limit still holds every byte."""
    rt = dmem.Runtime(backend="host", host_capacity=16 * MiB, device_limit=16 * MiB,
                      spill_dir=str(tmp_path))
    d = DmemWorkerData(runtime=rt, device_memory_limit="4MiB",
                       worker_local_directory=str(tmp_path / "local"))
    try:
        for i in range(12):  # 6 MiB of 512 KiB keys
            d[i] = chunk(i)
        gc.collect()
        s = rt.stats()
        assert s["device_used"] - s["raw_used"] <= 4 * MiB, s
        assert s["spill_count"] >= 4 and d.counts["target_evictions"] >= 1
        assert [i for i in range(12) if d.tier_of(i) != "device"] == [0, 1, 2, 3]  # LRU first
        # a task's 6 MiB of temporaries: over the target, under the runtime's
        # limit: no stored key leaves for it
        tmp = rt.device_malloc(6 * MiB)
        before = rt.stats()["spill_count"]
        d[12] = chunk(12)
        assert rt.stats()["spill_count"] == before + 1  # one key for one key
        del tmp
        gc.collect()
        for i in range(13):
            np.testing.assert_array_equal(d[i], chunk(i))
        s = rt.stats()
        assert s["device_used"] - s["raw_used"] <= 4 * MiB + 512 * KiB, s  # d[12]'s read
    finally:
        d.close()
        gc.collect()
        rt.close()


def test_device_memory_limit_share_of_the_device(tmp_path):
    rt = dmem.Runtime(backend="host", host_capacity=8 * MiB, spill_dir=str(tmp_path))
    d = DmemWorkerData(runtime=rt, device_memory_limit="25%",
                       worker_local_directory=str(tmp_path / "local"))
    try:
        assert d._target == 2 * MiB
    finally:
        d.close()
        rt.close()
    with pytest.raises(ValueError):
        rt2 = dmem.Runtime(backend="host", host_capacity=8 * MiB, spill_dir=str(tmp_path))
        try:
            DmemWorkerData(runtime=rt2, device_memory_limit="150%",
                           worker_local_directory=str(tmp_path / "l2"))
        finally:
            rt2.close()


class _TS:
    def __init__(self, deps):
        self.dependencies = [type("Dep", (), {"key": k})() for k in deps]


class _FakeWorker:
    def __init__(self, ready):
        self.state = type("State", (), {"ready": ready, "executing": set(), "constrained": []})()


def test_keys_needed_by_ready_tasks_spill_last(d):
    for i in range(8):
        d[i] = chunk(i)
    gc.collect()
    w = _FakeWorker([_TS([0, 1])])  # 0 and 1 are the coldest but needed soon
    d.attach(w)
    d[8] = chunk(8)
    d[9] = chunk(9)
    gc.collect()
    assert d.tier_of(0) == "device" and d.tier_of(1) == "device"
    assert d.tier_of(2) != "device"
    d.attach(None)
    for i in range(10):
        np.testing.assert_array_equal(d[i], chunk(i))


class _Task:
    """A worker TaskState as far as the mapping looks at it."""

    def __init__(self, key, state="memory"):
        self.key, self.state = key, state
        self.dependencies, self.dependents = [], []

    def needs(self, *deps):
        for dep in deps:
            self.dependencies.append(dep)
            dep.dependents.append(self)
        return self


class _GraphWorker:
    def __init__(self, tasks):
        self.state = type("State", (), {"ready": [], "executing": set(), "constrained": [],
                                        "tasks": tasks})()


def test_keys_no_task_still_needs_are_cold_and_spill_first(d):
    x = [_Task(("x", i)) for i in range(6)]
    y0 = _Task("y0", "executing").needs(x[0], x[1])
    y1 = _Task("y1", "waiting").needs(x[1], x[2])
    tasks = {t.key: t for t in x + [y0, y1]}
    w = _GraphWorker(tasks)  # the mapping holds it weakly
    d.attach(w)
    for i in range(6):
        d[("x", i)] = chunk(i)
    a, b = d[("x", 0)], d[("x", 1)]  # y0 reads them: x0 and x1 are the most recently used
    del a, b
    gc.collect()
    d["y0"] = chunk(10)  # y0 done: nothing here needs x0 any more; y1 still needs x1
    y0.state = "memory"  # as the worker marks it once its result is stored
    bufs = {i: d._dev[("x", i)].leaves[0].buf for i in range(6)}
    assert bufs[0].priority == ddata.COLD
    assert all(bufs[i].priority == 0 for i in range(1, 6))
    d["z"] = chunk(11)
    d["z2"] = chunk(12)  # 4.5 MiB under 4: something must go
    gc.collect()
    tiers = {i: d.tier_of(("x", i)) for i in range(6)}
    assert tiers[0] != "device", tiers  # cold, though not least recently used
    # evict() takes the cold key's host bytes first too
    if tiers[0] == "host":
        d.evict()
        assert d.tier_of(("x", 0)) == "disk"
    # a task reading a cold key makes it warm again
    np.testing.assert_array_equal(d[("x", 0)], chunk(0))
    gc.collect()
    assert bufs[0].priority == 0 and ("x", 0) not in d._cold
    y1.state = "memory"
    tasks["y1"] = y1
    d["y1"] = chunk(13)  # x1 and x2 are cold now
    assert bufs[1].priority == ddata.COLD and bufs[2].priority == ddata.COLD
    d.attach(None)
    for i in range(6):
        np.testing.assert_array_equal(d[("x", i)], chunk(i))


def test_evict_moves_host_tier_keys_to_disk(d):
    for i in range(10):  # 5 MiB under a 4 MiB limit: some on the host tier
        d[i] = chunk(i)
    gc.collect()
    host = [i for i in range(10) if d.tier_of(i) == "host"]
    assert host
    assert set(host) <= set(d.fast)
    freed = d.evict()
    assert freed == chunk(0).nbytes
    assert d.tier_of(host[0]) == "disk"  # the least recently used first
    while d.fast:
        assert d.evict() > 0
    assert d.evict() == -1  # nothing left: the protocol's answer
    assert all(d.tier_of(i) in ("device", "disk") for i in range(10))
    assert d.spilled_total[0] >= len(host) * chunk(0).nbytes
    for i in range(10):
        np.testing.assert_array_equal(d[i], chunk(i))


def test_evict_falls_back_to_host_values(d):
    d["b"] = b"x" * 1000
    assert list(d.fast) == ["b"]
    assert d.evict() > 0
    assert d.tier_of("b") == "host-value-disk" and d["b"] == b"x" * 1000


def test_evict_never_raises(d, monkeypatch):
    for i in range(10):
        d[i] = chunk(i)
    gc.collect()

    monkeypatch.setattr(d, "_lru", None)  # anything going wrong inside
    assert d.evict() == -1
    monkeypatch.undo()
    for i in range(10):
        np.testing.assert_array_equal(d[i], chunk(i))


def test_serialize_sends_spilled_bytes_without_unspilling(d):
    d["k"] = (chunk(1), {"y": np.asfortranarray(chunk(2))}, "meta")
    for leaf in d._dev["k"].leaves:
        leaf.buf.spill("disk")
    before = d.runtime.stats()
    token = ddata.for_transfer.set(True)
    try:
        v = d["k"]
    finally:
        ddata.for_transfer.reset(token)
    assert isinstance(v, DmemValue)
    n = dser.calls["dask"]
    from_disk = dser.timing["from_deferred_disk"]
    header, frames = serialize(v, serializers=("dask",))
    assert dser.calls["dask"] == n + 1
    assert dser.timing["from_deferred_disk"] == from_disk + 2  # both arrays, read from disk
    assert dser.timing["serialize_s"] > 0
    after = d.runtime.stats()
    assert after["unspill_count"] == before["unspill_count"]
    assert all(leaf.buf.state == "deferred_disk" for leaf in d._dev["k"].leaves)
    got = deserialize(header, frames)
    np.testing.assert_array_equal(got[0], chunk(1))
    np.testing.assert_array_equal(got[1]["y"], chunk(2))
    assert got[1]["y"].flags.f_contiguous and got[2] == "meta"
    # pickle (the last-resort family) sends the same
    got = pickle.loads(pickle.dumps(v))
    np.testing.assert_array_equal(got[0], chunk(1))
    # a receiving mapping stores it in its own buffers
    d["copy"] = got
    np.testing.assert_array_equal(d["copy"][1]["y"], chunk(2))


class _Comm:
    def __init__(self, local, peer):
        self.local_address = local
        self.peer_address = peer


def test_ipc_only_between_workers_of_one_host():
    from dmem.dask.ipc import same_host

    w = "tcp://127.0.0.1:40001"
    assert same_host(_Comm("tcp://127.0.0.1:40000", "tcp://127.0.0.1:51234"), w)
    assert same_host(_Comm("tls://10.0.0.5:1", "tls://10.0.0.5:2"), "tls://10.0.0.5:3")
    assert not same_host(_Comm("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"), None)  # a client
    assert not same_host(None, w)
    assert not same_host(_Comm("tcp://10.0.0.5:1", "tcp://10.0.0.6:2"), "tcp://10.0.0.6:3")
    assert not same_host(_Comm("tcp://10.0.0.5:1", "tcp://10.0.0.5:2"), "tcp://10.0.0.6:3")
    assert not same_host(_Comm("inproc://a/1/2", "inproc://a/1/3"), "inproc://a/1/4")
    assert not same_host(_Comm("ucx://10.0.0.5:1", "ucx://10.0.0.5:2"), "ucx://10.0.0.5:3")
    assert not same_host(_Comm("garbage", "tcp://127.0.0.1:2"), w)


def test_ipc_option_and_transfer(d, monkeypatch):
    from dmem.dask.ipc import Transfer, enabled_by_default
    from dmem.dask.plugin import DmemWorkerPlugin

    monkeypatch.delenv("DMEM_DASK_IPC", raising=False)
    assert enabled_by_default() is True
    for v, want in (("0", False), ("off", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("DMEM_DASK_IPC", v)
        assert enabled_by_default() is want
    monkeypatch.setenv("DMEM_DASK_IPC", "maybe")
    with pytest.raises(ValueError, match="DMEM_DASK_IPC"):
        enabled_by_default()
    with pytest.raises(TypeError, match="ipc"):
        DmemWorkerPlugin(ipc="yes")
    p = pickle.loads(pickle.dumps(DmemWorkerPlugin(ipc=False)))
    assert p.ipc is False
    # the host backend has no CUDA IPC, whatever the connection
    comm = _Comm("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")
    assert not Transfer.for_call(d.runtime, True, comm, "tcp://127.0.0.1:3").ipc
    # a Transfer that allows IPC still sends host arrays as bytes
    d["k"] = (chunk(4), "meta")
    t = Transfer(ipc=True)
    token = ddata.for_transfer.set(t)
    try:
        v = d["k"]
    finally:
        ddata.for_transfer.reset(token)
    assert v.transfer is t
    sent = dser.timing["ipc_sent"]
    header, frames = serialize(v, serializers=("dask",))
    assert "ipc" not in header and dser.timing["ipc_sent"] == sent and t.held == 0
    got = deserialize(header, frames)
    np.testing.assert_array_equal(got[0], chunk(4))
    # held arrays are dropped by release, and only then
    a = d["k"][0]
    t.hold(a)
    buf = d._dev["k"].leaves[0].buf
    del a
    gc.collect()
    assert buf.exposed and t.held == 1
    t.release()
    gc.collect()
    assert not buf.exposed and t.held == 0


def test_leaves_never_pickle(d):
    d["k"] = chunk(1)
    with pytest.raises(TypeError):
        pickle.dumps(d._dev["k"].leaves[0])


def test_metrics_and_repr(d):
    d["k"] = chunk(1)
    m = d.metrics()
    assert m["dmem-device-bytes"] == chunk(1).nbytes and m["dmem-device-keys"] == 1
    assert m["dmem-copied"] == 1 and "1 device keys" in repr(d)


def test_bad_arguments(tmp_path):
    with pytest.raises(TypeError):
        DmemWorkerData(runtime="not a runtime", worker_local_directory=str(tmp_path))
    rt = dmem.Runtime(backend="host", host_capacity=MiB, spill_dir=str(tmp_path))
    rt.close()
    with pytest.raises(ValueError):
        DmemWorkerData(runtime=rt, worker_local_directory=str(tmp_path))
    for bad in (-1, 1.5, "x", True):
        with pytest.raises(ValueError):
            DmemWorkerData(backend="host", host_target=bad, worker_local_directory=str(tmp_path))
    with pytest.raises(ValueError):
        dmem.dask.LocalCluster(processes=False)
    with pytest.raises(ValueError):
        dmem.dask.LocalCluster(backend="tpu")
    with pytest.raises(ValueError):
        dmem.dask.LocalCluster(n_workers=-1, backend="host")


def test_host_burst_reaches_the_runtime(tmp_path):
    from dmem.dask.cluster import worker_options

    assert worker_options("host", host_burst=0.2)["data"][1]["host_burst"] == 0.2
    assert "host_burst" not in worker_options("host")["data"][1]
    with pytest.raises(ValueError):
        DmemWorkerData(backend="host", device_memory_limit=4 * MiB, host_memory_limit=MiB,
                       host_burst=2.0, worker_local_directory=str(tmp_path))
    with pytest.raises(TypeError):
        DmemWorkerData(backend="host", device_memory_limit=4 * MiB, host_memory_limit=MiB,
                       host_burst="20%", worker_local_directory=str(tmp_path))
    # with no burst the host tier never holds more than its limit: what does
    # not fit goes to disk as it is spilled
    d = DmemWorkerData(backend="host", device_memory_limit=2 * MiB, host_memory_limit=MiB,
                       host_burst=0.0, spill_dir=str(tmp_path),
                       worker_local_directory=str(tmp_path / "local"))
    try:
        peak = 0
        for i in range(8):                   # 4 MiB of chunks on a 2 MiB device
            d[i] = chunk(i)
            peak = max(peak, d.runtime.stats()["host_used"])
        s = d.runtime.stats()
        assert peak <= MiB and s["disk_used"] > 0 and not d.counts["fallbacks"], (peak, s)
        for i in range(8):
            np.testing.assert_array_equal(d[i], chunk(i))
    finally:
        d.close()
        gc.collect()
        if d._owned:
            d.runtime.close()


def test_host_headroom_reaches_the_runtime(tmp_path, monkeypatch):
    """dmem.dask's workers get a headroom of DASK_HOST_HEADROOM (0) unless
    host_headroom or DMEM_HOST_HEADROOM gives one; a given one reaches the
    runtime as it is (a size as Dask reads it)."""
    from dmem.dask import data as dask_data
    from dmem.dask.cluster import worker_options

    assert dask_data.DASK_HOST_HEADROOM == 0
    assert worker_options("host", host_headroom="64MiB")["data"][1]["host_headroom"] == "64MiB"
    assert "host_headroom" not in worker_options("host")["data"][1]
    monkeypatch.delenv("DMEM_HOST_HEADROOM", raising=False)

    def headroom(**kw):
        d = DmemWorkerData(backend="host", device_memory_limit=4 * MiB, spill_dir=str(tmp_path),
                           worker_local_directory=str(tmp_path / "local"), **kw)
        try:
            return d.runtime.info()["host_headroom"]
        finally:
            d.close()
            gc.collect()
            if d._owned:
                d.runtime.close()

    assert headroom() == 0                                   # dmem.dask's default
    assert headroom(host_headroom="64MiB") == 64 * MiB       # given
    assert headroom(host_headroom="100MB") == 100 * 10**6    # as Dask reads sizes
    assert headroom(host_headroom=3 * MiB) == 3 * MiB
    monkeypatch.setenv("DMEM_HOST_HEADROOM", "16MiB")
    assert headroom() == 16 * MiB                            # the environment's
    assert headroom(host_headroom=0) == 0                    # the argument wins
    monkeypatch.delenv("DMEM_HOST_HEADROOM")
    for bad in (-1, "lots", "10%"):
        with pytest.raises(ValueError):
            headroom(host_headroom=bad)
    with pytest.raises(TypeError):
        headroom(host_headroom=1.5)


def test_a_controller_already_installed_is_kept(tmp_path):
    rt = dmem.Runtime(backend="host", host_capacity=MiB, spill_dir=str(tmp_path))
    mine = dmem.Controller()
    rt.set_controller(mine)
    d = DmemWorkerData(runtime=rt, worker_local_directory=str(tmp_path))
    assert rt.controller is mine
    d["k"] = chunk(1, (64, 64))
    np.testing.assert_array_equal(d["k"], chunk(1, (64, 64)))
    d.close()
    assert rt.controller is mine
    rt.set_controller(None)
    rt.close()


def test_many_cycles_lose_nothing(d):
    rng = np.random.default_rng(1)
    ref = {}
    for step in range(300):
        k = int(rng.integers(0, 16))
        op = rng.integers(0, 4)
        if op == 0 or k not in ref:
            ref[k] = chunk(step, (128, 128))
            d[k] = ref[k]
        elif op == 1:
            np.testing.assert_array_equal(d[k], ref[k])
        elif op == 2:
            del d[k], ref[k]
        else:
            d.evict()
    gc.collect()
    for k, v in ref.items():
        np.testing.assert_array_equal(d[k], v)
    assert len(d) == len(ref)
    assert d.runtime.stats()["buffer_count"] == len(ref)


def test_mapping_made_by_the_worker_uses_the_default_runtime(tmp_path):
    # what distributed does with data=(DmemWorkerData, {...}): a fresh
    # process, so that the default runtime is configured by the mapping
    from conftest import run_python

    r = run_python(f"""
        import dmem, numpy as np
        from dmem.dask import DmemWorkerData
        d = DmemWorkerData(device_memory_limit=2 << 20, backend="host",
                           worker_local_directory={str(tmp_path)!r})
        assert d.runtime is dmem.default_runtime(), d.runtime
        assert d.runtime.stats()["device_limit"] == 2 << 20
        d["a"] = np.ones(1000)
        # a second mapping in the process gets a runtime of its own
        e = DmemWorkerData(device_memory_limit=1 << 20, backend="host",
                           worker_local_directory={str(tmp_path)!r})
        assert e.runtime is not d.runtime and not e.runtime.is_default
        e.close(); d.close()
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout


class _Ns:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_adoption_of_a_block_from_the_runtimes_allocator(d):
    # What a CuPy array made through dmem.cupy looks like to the mapping
    # (array.data.mem._owner is the DeviceMemory): adopted in place, locked
    # while the DeviceMemory lives. The host backend has no CuPy, so the
    # array is a stand-in with CuPy's attributes.
    mem = d.runtime.device_malloc(4096)
    payload = np.arange(256, dtype=np.float64)  # 2 KiB at offset 1 KiB
    src = _Ns(data=_Ns(mem=_Ns(_owner=mem), ptr=mem.ptr + 1024), nbytes=payload.nbytes,
              shape=payload.shape, dtype=payload.dtype, strides=payload.strides)
    leaf = dmem.arrays.adopt(d.runtime, src, "cupy")
    assert leaf is not None and leaf.adopted and leaf.offset == 1024
    assert mem.adopted and leaf.buf.size == 4096 and leaf.buf.lock_count == 1
    assert d.runtime.stats()["raw_used"] == 0
    # a second array over the same block is not adopted twice (copied instead)
    assert dmem.arrays.adopt(d.runtime, src, "cupy") is None
    # another runtime's block is not adopted
    other = dmem.Runtime(backend="host", host_capacity=MiB)
    omem = other.device_malloc(4096)
    osrc = _Ns(data=_Ns(mem=_Ns(_owner=omem), ptr=omem.ptr), nbytes=8, shape=(1,),
               dtype=np.dtype("f8"), strides=(8,))
    assert dmem.arrays.adopt(d.runtime, osrc, "cupy") is None
    del osrc, omem
    other.close()
    leaf.buf.write(payload.tobytes(), 1024)
    with pytest.raises(dmem.BusyError):
        leaf.buf.spill("host")  # the array (its DeviceMemory) still holds it
    del src, mem
    gc.collect()
    assert leaf.buf.lock_count == 0
    leaf.buf.spill("disk")
    assert leaf.buf.peek(payload.nbytes, 1024) == payload.tobytes()
    leaf.buf.free()


def test_prefetch_brings_spilled_keys_back_without_locking(d):
    for i in range(10):  # 5 MiB under a 4 MiB limit
        d[i] = chunk(i)
    d["h"] = b"host value"
    gc.collect()
    spilled = [i for i in range(10) if d.tier_of(i) != "device"]
    assert spilled
    d[spilled[0]]  # now it is back and recent
    gc.collect()
    spilled = [i for i in range(10) if d.tier_of(i) != "device"]
    target = spilled[-1]
    d._dev[target].leaves[0].buf.spill("disk")
    before = d.runtime.stats()["prefetch_count"]
    n = d.prefetch([target, "h", "missing"])  # host values and missing keys: skipped
    assert n == 1 and d.counts["prefetched"] == 1
    d.runtime.poll()
    buf = d._dev[target].leaves[0].buf
    assert buf.state in ("resident", "unspilling") and buf.lock_count == 0
    assert d.runtime.stats()["prefetch_count"] == before + 1
    assert d.prefetch([target]) == 0 or buf.state != "resident"  # resident: nothing to do
    for i in range(10):
        np.testing.assert_array_equal(d[i], chunk(i))


class _HeapSet(list):
    def peekn(self, n):
        return self[:n]


def test_plugin_prefetches_the_next_ready_tasks_inputs(d):
    plugin = dmem.dask.DmemWorkerPlugin(use_dmem_for_cupy=False)
    for i in range(10):
        d[i] = chunk(i)
    gc.collect()
    spilled = [i for i in range(10) if d.tier_of(i) != "device"]
    assert len(spilled) >= 2
    w = type("W", (), {})()
    w.data = d
    w.state = type("S", (), {"ready": _HeapSet([_TS([spilled[0]]), _TS([spilled[1]])]),
                             "executing": set(), "nthreads": 1})()
    plugin._worker = w
    plugin.transition("t", "ready", "memory")  # not a task start: nothing
    assert d.counts["prefetched"] == 0
    plugin.transition("t", "ready", "executing")  # the next 1 ready task's inputs
    assert d.counts["prefetched"] == 1
    plugin.prefetch = False
    plugin.transition("t2", "ready", "executing")
    assert d.counts["prefetched"] == 1
    # what goes to the worker processes: the settings, not the worker
    import pickle as pk
    clone = pk.loads(pk.dumps(dmem.dask.DmemWorkerPlugin(prefetch=False)))
    assert clone.prefetch is False and clone._worker is None


def _for_transfer(d, key, transfer=True):
    token = ddata.for_transfer.set(transfer)
    try:
        return d[key]
    finally:
        ddata.for_transfer.reset(token)


def test_value_handed_to_get_data_outlives_its_key(d):
    """The scheduler releases a replica while get_data's message is still
    being serialised: the value handed out keeps its buffers alive and
    readable (whatever tier they are in), and they are freed once it goes."""
    d["k"] = (chunk(1), {"y": chunk(2)}, "meta")
    d._dev["k"].leaves[1].buf.spill("disk")
    bufs = [leaf.buf for leaf in d._dev["k"].leaves]
    v = _for_transfer(d, "k")
    base = d.runtime.stats()["buffer_count"]
    del d["k"]  # released while the message is being written
    assert "k" not in d
    d["k"] = chunk(9)  # and even replaced by a new value
    assert d.runtime.stats()["buffer_count"] == base + 1
    header, frames = serialize(v, serializers=("dask",))
    assert header.get("serializer") == "dask", header  # not "error"
    got = deserialize(header, frames)
    np.testing.assert_array_equal(got[0], chunk(1))
    np.testing.assert_array_equal(got[1]["y"], chunk(2))
    got = pickle.loads(pickle.dumps(v))  # pickle reads the same bytes
    np.testing.assert_array_equal(got[1]["y"], chunk(2))
    np.testing.assert_array_equal(d["k"], chunk(9))
    del v, got
    gc.collect()
    # the message is gone: the released key's buffers are freed, the new one stays
    assert d.runtime.stats()["buffer_count"] == base - 1
    for b in bufs:
        with pytest.raises(dmem.StaleHandleError):
            b.state


def test_values_in_flight_keep_their_buffers_until_the_last_goes(d):
    """Two answers hold one key; the mapping closes meanwhile. The buffers
    live until both values are gone, on whatever thread that happens."""
    import threading

    d["k"] = chunk(3)
    buf = d._dev["k"].leaves[0].buf
    v1, v2 = _for_transfer(d, "k"), _for_transfer(d, "k")
    del d["k"]
    out = []
    t = threading.Thread(target=lambda: out.append(serialize(v1, serializers=("dask",))))
    t.start()
    t.join()
    np.testing.assert_array_equal(deserialize(*out[0]), chunk(3))
    del v1, out
    gc.collect()
    assert buf.state == "resident"  # v2 still holds it
    d.close()  # the worker closes with an answer in flight
    np.testing.assert_array_equal(deserialize(*serialize(v2, serializers=("dask",))), chunk(3))
    del v2
    gc.collect()
    with pytest.raises(dmem.StaleHandleError):
        buf.state


@pytest.mark.parametrize("text", ["12MB", "12M", "12 MB", "12MiB", "12Mi", "5.5MB", "12582912"])
def test_sizes_are_read_as_dask_reads_them(tmp_path, text):
    """device_memory_limit="8GB" is 8e9 bytes for dmem.dask as for Dask and
    dask-cuda (dask.utils.parse_bytes), "8GiB" is 2**33."""
    from dask.utils import parse_bytes

    d = DmemWorkerData(backend="host", device_memory_limit=text, host_memory_limit="1MB",
                       spill_dir=str(tmp_path), worker_local_directory=str(tmp_path / "local"))
    try:
        assert d.runtime.stats()["device_limit"] == parse_bytes(text)
    finally:
        d.close()
        if d._owned:
            d.runtime.close()


def test_bad_sizes_raise_typed_errors(tmp_path):
    from dmem.dask.data import parse_size

    assert parse_size("8GB") == 8 * 10**9 and parse_size("8GiB") == 8 << 30
    assert parse_size("80%") == "80%" and parse_size(None) is None and parse_size(7) == 7
    for bad, exc in (("lots", ValueError), ("8 foos", ValueError), (-1, ValueError),
                     (1.5, TypeError), (True, TypeError), ([8], TypeError)):
        with pytest.raises(exc, match="device_memory_limit"):
            DmemWorkerData(backend="host", device_memory_limit=bad,
                           worker_local_directory=str(tmp_path))
