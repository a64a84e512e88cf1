"""dmem workers in real distributed clusters, on the host backend (NumPy
chunks are the device arrays): dmem.dask.LocalCluster with 2 worker
processes on a dask.array graph 3x the workers' device limits, the
python -m dmem.dask.worker CLI against a separate scheduler, worker restart
and task retry, and a worker killed mid-spill."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import dmem  # noqa: E402
import dmem.dask  # noqa: E402

MiB = 1 << 20
N, CH = 2048, 256  # a 2048^2 float64 array (32 MiB) in 64 chunks of 512 KiB
LIMIT = 16 * MiB // 3  # per worker: the array alone is 3x the two workers' limits


def values(i, j):
    # integers held as float64, so that every sum is exact
    return ((i * 7 + j * 3) % 1000).astype(np.float64)


def the_array():
    return da.fromfunction(values, shape=(N, N), chunks=CH, dtype=np.float64)


REF = values(*np.indices((N, N)))


def _env():
    env = dict(os.environ)
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(dmem.__file__)))
    env["PYTHONPATH"] = pkg + os.pathsep + env.get("PYTHONPATH", "")
    env["DMEM_BACKEND"] = "host"
    return env


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    spill = tmp_path_factory.mktemp("spill")
    os.environ["PYTHONPATH"] = _env()["PYTHONPATH"]  # the spawned workers import dmem
    c = dmem.dask.LocalCluster(n_workers=2, backend="host", device_memory_limit=LIMIT,
                               host_memory_limit=64 * MiB, spill_dir=str(spill),
                               threads_per_worker=2, dashboard_address=":0",
                               memory_limit="2GiB")
    yield c, spill
    c.close()


def worker_stats(client):
    def stats(dask_worker):
        d = dask_worker.data
        s = d.runtime.stats()
        return {"type": type(d).__name__, "spills": s["spill_count"], "device": s["device_used"],
                "limit": s["device_limit"], "sent": d.counts["sent"],
                "serialized": sum(dmem.dask.serialize.calls.values()),
                "host_values": len(d.host), "dev_keys": len(d._dev),
                "prefetched": d.counts["prefetched"], "prefetch_count": s["prefetch_count"],
                "env_backend": d.runtime.backend}

    return client.run(stats)


def test_local_cluster_spills_in_place_3x_the_device_limit(cluster):
    c, _ = cluster
    with distributed.Client(c) as client:
        assert len(client.scheduler_info()["workers"]) == 2
        x = the_array()
        y = (x + x.T).persist()
        distributed.wait(y)
        st = worker_stats(client)
        for s in st.values():
            assert s["type"] == "DmemWorkerData" and s["env_backend"] == "host"
            assert s["limit"] == LIMIT and s["device"] <= LIMIT
            assert s["host_values"] == 0  # every chunk is in dmem, none pickled to disk
        assert sum(s["spills"] for s in st.values()) > 0, st
        # tasks starting prefetched the spilled inputs of the next ready ones
        assert sum(s["prefetched"] for s in st.values()) > 0, st
        assert sum(s["prefetch_count"] for s in st.values()) > 0, st
        assert sum(s["dev_keys"] for s in st.values()) >= 64
        total = y.sum().compute()
        assert total == 2 * REF.sum()
        np.testing.assert_array_equal(y[:CH + 5, -CH - 3:].compute(),
                                      (REF + REF.T)[:CH + 5, -CH - 3:])
        st = worker_stats(client)
        # values only cross process boundaries when sent; spilling serialised none
        sent = sum(s["sent"] for s in st.values())
        assert sent > 0  # x.T needs chunks of the other worker: they went as DmemValues
        assert sum(s["serialized"] for s in st.values()) == sent
        metrics = client.scheduler_info()["workers"]
        for w in metrics.values():
            assert "dmem-device-bytes" in w["metrics"], w["metrics"].keys()
        del y


def test_fetched_replicas_are_dropped_once_no_task_needs_them(cluster):
    """x persisted, then x + x.T: each worker fetches chunks of x from the
    other. With the scheduler's periodic AMM stopped, the workers' plugin
    alone must get those copies dropped (a ReduceReplicas run it asks for
    once a fetched key has no task left that needs it), so that they do not
    take device room from the keys; before it, they stayed until the AMM's
    next run, 2 s later by default."""
    c, _ = cluster
    with distributed.Client(c) as client:
        client.amm.stop()
        try:
            x = the_array().persist()
            distributed.wait(x)
            y = (x + x.T).persist()
            distributed.wait(y)

            def replicated(dask_scheduler):
                return len(dask_scheduler.replicated_tasks)

            def requests(dask_worker):
                return dask_worker.plugins["dmem"].replica_requests

            deadline = time.monotonic() + 20
            while client.run_on_scheduler(replicated) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert client.run_on_scheduler(replicated) == 0
            assert sum(client.run(requests).values()) > 0
            # one copy of each key is left (AMM chooses which: the fetched
            # one or the original)
            held = client.run_on_scheduler(
                lambda dask_scheduler: sum(len(ts.who_has or ()) for ts in
                                           dask_scheduler.tasks.values() if ts.state == "memory"))
            assert held == 2 * (N // CH) ** 2
            assert y.sum().compute() == 2 * REF.sum()
            del x, y
        finally:
            client.amm.start()


def test_the_fetched_copy_is_the_one_dropped(cluster):
    """The same graph: once no task of a worker needs a key it fetched, the
    scheduler drops that worker's copy, not the peer's original (which
    ReduceReplicas may pick: it drops from the worker using the most
    memory). Every key of x is left where it was computed, and no worker
    holds a fetched copy; the scheduler never dropped a last copy (every key
    has one holder and the sums are exact)."""
    c, _ = cluster
    with distributed.Client(c) as client:
        client.amm.stop()
        try:
            x = the_array().persist()
            distributed.wait(x)
            y = (x + x.T).persist()
            distributed.wait(y)

            def fetched(dask_worker):
                return sum(1 for ts in dask_worker.state.tasks.values()
                           if ts.state == "memory" and ts.run_spec is None)

            def replicated(dask_scheduler):
                return len(dask_scheduler.replicated_tasks)

            deadline = time.monotonic() + 20
            while (client.run_on_scheduler(replicated) or sum(client.run(fetched).values())) \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            assert client.run_on_scheduler(replicated) == 0
            assert client.run(fetched) == {w: 0 for w in client.run(fetched)}
            dropped = client.run(lambda dask_worker: dask_worker.plugins["dmem"].replicas_dropped)
            assert sum(dropped.values()) > 0
            on_scheduler = client.run_on_scheduler(
                lambda dask_scheduler: dask_scheduler.plugins["dmem-drop-fetched"].dropped)
            assert on_scheduler == sum(dropped.values())
            assert y.sum().compute() == 2 * REF.sum()
            assert x.sum().compute() == REF.sum()
            del x, y
        finally:
            client.amm.start()


def test_plugin_options_are_checked():
    with pytest.raises(TypeError):
        dmem.dask.DmemWorkerPlugin(reduce_replicas="yes")
    with pytest.raises(TypeError):
        dmem.dask.DmemWorkerPlugin(ipc=1)


def test_restart_and_retry_lose_nothing(cluster, tmp_path):
    c, _ = cluster
    marker = tmp_path / "failed-once"

    def flaky(block, path=str(marker)):
        if not os.path.exists(path):
            open(path, "w").close()
            raise RuntimeError("first try fails")
        return block * 2

    with distributed.Client(c) as client:
        x = the_array()
        y = x.map_blocks(flaky, dtype=np.float64)
        fut = client.compute(y.sum(), retries=2)
        assert fut.result() == 2 * REF.sum()
        z = (x + 1).persist()
        distributed.wait(z)
        one = sorted(client.scheduler_info()["workers"])[0]
        client.restart_workers([one])
        # the keys of the restarted worker are recomputed
        assert z.sum().compute() == REF.sum() + N * N
        client.restart()
        assert the_array().sum().compute() == REF.sum()


def test_cli_workers_join_a_remote_scheduler(tmp_path):
    env = _env()
    sched_file = tmp_path / "scheduler.json"
    sched = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
         "--port", "0", "--no-dashboard", "--scheduler-file", str(sched_file)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers = None
    try:
        for _ in range(300):
            if sched_file.exists() and sched_file.stat().st_size:
                break
            time.sleep(0.1)
        addr = json.loads(sched_file.read_text())["address"]
        workers = subprocess.Popen(
            [sys.executable, "-m", "dmem.dask.worker", addr, "--backend", "host", "--n-workers",
             "2", "--device-memory-limit", str(LIMIT), "--nthreads", "2", "--name", "cli",
             "--spill-dir", str(tmp_path), "--host", "127.0.0.1"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        with distributed.Client(addr, timeout=60) as client:
            client.wait_for_workers(2, timeout=120)
            names = sorted(w["name"] for w in client.scheduler_info()["workers"].values())
            assert names == ["cli-0", "cli-1"]
            # the scheduler and workers are other programs: the test module is
            # not importable there, so the block function goes by value
            # (cloudpickle pickles a lambda with its code)
            x = da.fromfunction(lambda i, j: ((i * 7 + j * 3) % 1000).astype(np.float64),
                                shape=(N, N), chunks=CH, dtype=np.float64)
            assert (x + x.T).sum().compute() == 2 * REF.sum()
            np.testing.assert_array_equal((x + x.T)[:300, -200:].compute(),
                                          (REF + REF.T)[:300, -200:])
            types = client.run(lambda dask_worker: type(dask_worker.data).__name__)
            assert set(types.values()) == {"DmemWorkerData"}
        workers.send_signal(signal.SIGTERM)
        out, _ = workers.communicate(timeout=60)
        assert workers.returncode == 0, out
        assert "2 host worker(s) connected" in out
    finally:
        for p in (workers, sched):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_cli_bad_arguments():
    r = subprocess.run([sys.executable, "-m", "dmem.dask.worker"], env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "scheduler" in r.stderr
    r = subprocess.run([sys.executable, "-m", "dmem.dask.worker", "tcp://127.0.0.1:1",
                        "--backend", "host", "--n-workers", "0"], env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--n-workers" in r.stderr


def _files(root):
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]


def test_worker_killed_mid_spill_recovers_and_leaves_no_files(tmp_path):
    spill = tmp_path / "spill"
    spill.mkdir()
    os.environ["PYTHONPATH"] = _env()["PYTHONPATH"]
    # a small host tier: spills go on to disk
    with dmem.dask.LocalCluster(n_workers=2, backend="host", device_memory_limit=LIMIT,
                                host_memory_limit=2 * MiB, spill_dir=str(spill),
                                threads_per_worker=2, dashboard_address=":0",
                                memory_limit="2GiB") as c, distributed.Client(c) as client:
        x = the_array()
        y = (x * 3).persist()
        # kill one worker as soon as it has bytes on disk
        victim = None
        deadline = time.time() + 60
        while victim is None and time.time() < deadline:
            disk = client.run(lambda dask_worker: dask_worker.data.runtime.stats()["disk_used"])
            for addr, n in disk.items():
                if n > 0:
                    victim = addr
                    break
            time.sleep(0.05)
        assert victim is not None, "nothing reached the disk tier"
        pid = client.run(os.getpid, workers=[victim])[victim]
        os.kill(pid, signal.SIGKILL)
        # the nanny restarts it; the scheduler recomputes what it held
        assert y.sum().compute() == 3 * REF.sum()
        del y
    # the killed worker could not clean up, but its files were unlinked when made
    assert _files(spill) == [], _files(spill)


def test_memory_manager_evicts_host_tier_keys_to_disk(tmp_path):
    # Dask's memory manager sees the process memory over its spill
    # threshold (a 1 % threshold: always) and calls evict() until fast is
    # empty: dmem's host-tier bytes go to dmem's disk tier.
    import dask

    os.environ["PYTHONPATH"] = _env()["PYTHONPATH"]
    cfg = {"distributed.worker.memory.spill": 0.01, "distributed.worker.memory.target": False,
           "distributed.worker.memory.pause": False,
           "distributed.worker.memory.terminate": False,
           "distributed.worker.memory.monitor-interval": "50ms"}
    with dask.config.set(cfg), \
            dmem.dask.LocalCluster(n_workers=1, backend="host", device_memory_limit=LIMIT,
                                   host_memory_limit=256 * MiB, spill_dir=str(tmp_path),
                                   threads_per_worker=2, dashboard_address=":0",
                                   memory_limit="8GiB") as c, \
            distributed.Client(c) as client:
        x = the_array()
        y = (x + 1).persist()
        distributed.wait(y)

        def tiers(dask_worker):
            d = dask_worker.data
            s = d.runtime.stats()
            return {"disk": s["disk_used"], "host": s["host_used"],
                    "evictions": d.counts["evictions"], "fast": len(d.fast)}

        deadline = time.time() + 60
        while time.time() < deadline:
            (t,) = client.run(tiers).values()
            if t["evictions"] > 0 and t["host"] == 0:
                break
            time.sleep(0.1)
        assert t["evictions"] > 0 and t["disk"] > 0, t
        assert t["host"] == 0 and t["fast"] == 0, t
        assert y.sum().compute() == REF.sum() + N * N  # read back from disk


# ---- GPU placement: the parent's CUDA_VISIBLE_DEVICES, as dask-cuda does ----


def _gpus(monkeypatch, mask, n):
    """This process sees n GPUs through CUDA_VISIBLE_DEVICES=mask (None: unset)."""
    from dmem.dask import cluster

    if mask is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)
    monkeypatch.setattr(cluster, "gpu_count", lambda: n)
    return cluster


def test_workers_get_the_parents_visible_devices_in_order(monkeypatch):
    cluster = _gpus(monkeypatch, "2,3", 2)
    assert cluster.parent_devices() == ["2", "3"]
    assert cluster.cuda_masks(2) == ["2,3", "3,2"]
    assert cluster.cuda_masks(3) == ["2,3", "3,2", "2,3"]
    # devices= indexes into that list
    assert cluster.cuda_masks(1, devices=[1]) == ["3"]
    assert cluster.cuda_masks(2, devices=[1, 0]) == ["3,2", "2,3"]
    with pytest.raises(ValueError, match="out of range"):
        cluster.cuda_masks(1, devices=[2])
    with pytest.raises(ValueError, match="neither"):
        cluster.cuda_masks(1, devices=["x"])
    # GPU UUIDs, as batch systems and MIG give them
    u = "GPU-8f3c1a2b-0000-1111-2222-333344445555"
    m = "MIG-1c2d3e4f-aaaa-bbbb-cccc-ddddeeeeffff"
    cluster = _gpus(monkeypatch, f" {u} ,{m}", 2)
    assert cluster.cuda_masks(2) == [f"{u},{m}", f"{m},{u}"]
    assert cluster.cuda_masks(1, devices=[m]) == [m]
    # no variable: every GPU of the machine
    cluster = _gpus(monkeypatch, None, 3)
    assert cluster.cuda_masks(3) == ["0,1,2", "1,2,0", "2,0,1"]
    # more names than GPUs CUDA sees (a stale mask): those it sees
    cluster = _gpus(monkeypatch, "5,6,7", 2)
    assert cluster.parent_devices() == ["5", "6"]


def test_local_cluster_and_cli_pass_the_parents_devices(monkeypatch):
    from dmem.dask import worker

    _gpus(monkeypatch, "2,3", 2)
    args = worker._parser().parse_args(["tcp://127.0.0.1:1", "--name", "w"])
    backend, plan = worker._plan(args)
    assert backend == "cuda"
    assert plan == [("w-0", {"CUDA_VISIBLE_DEVICES": "2,3"}),
                    ("w-1", {"CUDA_VISIBLE_DEVICES": "3,2"})]
    args = worker._parser().parse_args(["tcp://127.0.0.1:1", "--name", "w", "--devices", "1"])
    assert worker._plan(args)[1] == [("w-0", {"CUDA_VISIBLE_DEVICES": "3"})]
    args = worker._parser().parse_args(["tcp://127.0.0.1:1", "--devices", "4"])
    with pytest.raises(SystemExit, match="out of range"):
        worker._plan(args)
    # LocalCluster: the env of the worker specs (no worker is started)
    with dmem.dask.LocalCluster(n_workers=0, backend="cuda", dashboard_address=None,
                                memory_limit="1GiB") as c:
        masks = []
        for i in range(2):
            c._i = i
            ((name, spec),) = c.new_worker_spec().items()
            masks.append(spec["options"]["env"]["CUDA_VISIBLE_DEVICES"])
        assert masks == ["2,3", "3,2"]
    with dmem.dask.LocalCluster(n_workers=0, backend="cuda", devices=[1],
                                dashboard_address=None, memory_limit="1GiB") as c:
        ((name, spec),) = c.new_worker_spec().items()
        assert spec["options"]["env"]["CUDA_VISIBLE_DEVICES"] == "3"


# ---- item 4 of issue 22: a host limit derived from the worker's memory_limit ----


def test_host_limit_is_derived_from_the_workers_memory_limit():
    from dmem.dask import cluster

    GiB = 1 << 30
    # the pinned pool's bound, H * (1 + burst) + staging, plus the rest of
    # the process stays under Dask's spill threshold (0.7 of memory_limit)
    for m in (4 * GiB, 16 * GiB, 100 * 10**9):
        h = cluster.default_host_limit(m)
        bound = h * (1 + cluster.DERIVED_HOST_BURST) + min(h / 4, GiB)
        assert bound + cluster.PROCESS_RESERVE <= 0.7 * m + 1, (m, h, bound)
        assert bound + cluster.PROCESS_RESERVE >= 0.7 * m - 2, (m, h, bound)  # all of it
    assert cluster.default_host_limit(None) is None and cluster.default_host_limit(0) is None
    assert cluster.default_host_limit(GiB) == 64 << 20  # next to no memory: a token tier
    # a larger burst leaves less for the tier itself
    assert cluster.default_host_limit(16 * GiB, 0.5) < cluster.default_host_limit(16 * GiB)
    # what LocalCluster and the CLI pass: derived unless given
    h, b = cluster.derived_host_options("16GiB", 1, None, None)
    assert (h, b) == (cluster.default_host_limit(16 * GiB), cluster.DERIVED_HOST_BURST)
    assert cluster.derived_host_options("16GiB", 1, "3GB", None) == ("3GB", None)
    assert cluster.derived_host_options("16GiB", 1, None, 0.5)[1] == 0.5
    assert cluster.derived_host_options(0, 1, None, None) == (None, None)
    # a host_staging given to the runtimes is the staging of the bound
    for staging in (4 * GiB, "4GiB"):
        h = cluster.default_host_limit(16 * GiB, host_staging=staging)
        bound = h * (1 + cluster.DERIVED_HOST_BURST) + 4 * GiB
        assert 0.7 * 16 * GiB - 2 <= bound + cluster.PROCESS_RESERVE <= 0.7 * 16 * GiB + 1
        assert cluster.derived_host_options("16GiB", 1, None, None, staging)[0] == h
    assert cluster.default_host_limit(16 * GiB, host_staging=4 * GiB) < cluster.default_host_limit(16 * GiB)
    with dmem.dask.LocalCluster(n_workers=0, backend="host", dashboard_address=None,
                                memory_limit="16GiB") as c:
        ((name, spec),) = c.new_worker_spec().items()
        data = spec["options"]["data"][1]
        assert data["host_memory_limit"] == cluster.default_host_limit(16 * GiB)
        assert data["host_burst"] == cluster.DERIVED_HOST_BURST
        assert c.host_memory_limit == data["host_memory_limit"]
    with dmem.dask.LocalCluster(n_workers=0, backend="host", dashboard_address=None,
                                memory_limit="16GiB", host_memory_limit="2GB") as c:
        ((name, spec),) = c.new_worker_spec().items()
        assert spec["options"]["data"][1]["host_memory_limit"] == "2GB"
        assert "host_burst" not in spec["options"]["data"][1]


def test_host_headroom_reaches_the_workers(tmp_path, monkeypatch):
    """LocalCluster(host_headroom=) reaches each worker's runtime as it is;
    without it the workers' runtimes get dmem.dask's default (0)."""
    monkeypatch.delenv("DMEM_HOST_HEADROOM", raising=False)
    for given, want in ((None, 0), ("64MiB", 64 << 20)):
        kw = {} if given is None else {"host_headroom": given}
        with dmem.dask.LocalCluster(n_workers=1, backend="host", dashboard_address=None,
                                    device_memory_limit="16MiB", threads_per_worker=1,
                                    memory_limit="4GiB", spill_dir=str(tmp_path),
                                    **kw) as c, distributed.Client(c) as client:
            ((name, spec),) = c.new_worker_spec().items()
            if given is None:
                assert "host_headroom" not in spec["options"]["data"][1]
            else:
                assert spec["options"]["data"][1]["host_headroom"] == given

            def worker_headroom(dask_worker):
                return dask_worker.data.runtime.info()["host_headroom"]

            got = client.run(worker_headroom)
            assert list(got.values()) == [want], got
