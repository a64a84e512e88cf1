"""The table of options (DMEM_CONFIG_OPTIONS, include/dmem/config.h) as the
Python side sees it: dmem._dmem._config_options() lists its rows; the
keywords of dmem.Runtime and dmem.configure are its keyword column; the
README's table of environment variables lists its variables; dmem.dask
passes the options it does not name itself through to the workers'
runtimes (eviction_policy through every path: keyword, environment,
DmemWorkerData, worker_options, LocalCluster and the worker CLI)."""

import gc
import os
import re

import pytest

import dmem

MiB = 1 << 20
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
ROWS = dmem._dmem._config_options()

# Variables of the README's table that are not options of a runtime: read
# by the trace recorder (every runtime of the process), by the fault
# injection of the tests, by dmem.dask's workers, by the host backend (a
# simulated link, for tests and bench_policy), by the disk tier (testing
# knobs for the GPU machine's disk), and by a runtime's pieces retrieves
# (DMEM_SWAP_PIECE, testing only).
NOT_OPTIONS = {"DMEM_TRACE", "DMEM_FAULT_INJECT", "DMEM_DASK_IPC", "DMEM_HOST_COPY_GBPS",
               "DMEM_DISK_WRITE_PIECE", "DMEM_DISK_FALLOCATE",
               "DMEM_DISK_READ_PIECE", "DMEM_SWAP_PIECE"}


def readme_variables():
    """The DMEM_* variables of the first column of the README's table under
    "## Configuration"."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    return [m.group(1) for m in re.finditer(r"^\| `(DMEM_\w+)` \|", section, re.M)]


def test_the_table_has_the_documented_columns():
    kinds = {"size", "size_or_percent", "fraction", "integer", "choice", "log", "path", "stats",
             "ahead"}
    assert ROWS, "no rows"
    for r in ROWS:
        assert set(r) == {"field", "kind", "env", "keyword", "choices", "doc"}, r
        assert r["kind"] in kinds, r
        assert r["doc"], r
        assert (r["choices"] is not None) == (r["kind"] in ("choice", "log")), r
    envs = [r["env"] for r in ROWS if r["env"]]
    keywords = [r["keyword"] for r in ROWS if r["keyword"]]
    assert len(envs) == len(set(envs)) and len(keywords) == len(set(keywords))


def test_readme_table_lists_every_variable_of_the_table():
    listed = readme_variables()
    assert len(listed) == len(set(listed)), f"listed twice: {listed}"
    envs = {r["env"] for r in ROWS if r["env"]}
    missing = envs - set(listed)
    assert not missing, f"options whose variable the README's table does not list: {missing}"
    unknown = set(listed) - envs - NOT_OPTIONS
    assert not unknown, f"README rows that are no option (nor in NOT_OPTIONS): {unknown}"


def test_every_keyword_of_the_table_is_accepted_and_nothing_else(tmp_path):
    keywords = [r["keyword"] for r in ROWS if r["keyword"]]
    # None leaves each at its default / environment value
    kw = dict.fromkeys(keywords)
    kw.update(backend="host", host_capacity=8 * MiB, spill_dir=str(tmp_path))
    with dmem.Runtime(**kw) as rt:
        assert rt.backend == "host"
    for r in ROWS:
        if r["keyword"] is None:
            name = r["field"]
            with pytest.raises(TypeError, match="unexpected keyword"):
                dmem.Runtime(backend="host", **{name: 1})
    with pytest.raises(TypeError, match="unexpected keyword"):
        dmem.configure(no_such_option=1)
    with pytest.raises(TypeError, match="positional"):
        dmem.configure("host")
    # positions follow the table's keyword order (backend, device, device_limit, ...)
    with dmem.Runtime("host", 0, 4 * MiB, None, str(tmp_path), 8 * MiB) as rt:
        info = rt.info()
        assert info["device_limit"] == 4 * MiB and info["device_capacity"] == 8 * MiB
    with pytest.raises(TypeError, match="given by name"):
        dmem.Runtime("host", backend="host")
    with pytest.raises(TypeError, match="at most"):
        dmem.Runtime(*([None] * (len(keywords) + 1)))


def test_choices_of_the_table_are_the_keyword_values(tmp_path, monkeypatch):
    """Each named choice of a keyword option reaches the runtime (the info
    key of the same name shows it); another string is a ValueError."""
    monkeypatch.delenv("DMEM_EVICTION_POLICY", raising=False)
    row = next(r for r in ROWS if r["keyword"] == "eviction_policy")
    for name in filter(None, row["choices"].split("|")):
        with dmem.Runtime(backend="host", host_capacity=8 * MiB, eviction_policy=name,
                          spill_dir=str(tmp_path)) as rt:
            assert rt.info()["eviction_policy"] == name
    with pytest.raises(ValueError, match="'lru' or 'reuse'"):
        dmem.Runtime(backend="host", eviction_policy="LRU")  # Python compares exactly
    with pytest.raises(ValueError):
        dmem.Runtime(backend="host", eviction_policy="")
    with pytest.raises(TypeError):
        dmem.Runtime(backend="host", eviction_policy=2)


def test_eviction_policy_from_the_environment_and_bad_values(tmp_path, monkeypatch):
    monkeypatch.setenv("DMEM_EVICTION_POLICY", "lru")
    with dmem.Runtime(backend="host", host_capacity=8 * MiB, spill_dir=str(tmp_path)) as rt:
        assert rt.info()["eviction_policy"] == "lru"
    # the keyword wins over the variable
    with dmem.Runtime(backend="host", host_capacity=8 * MiB, eviction_policy="reuse",
                      spill_dir=str(tmp_path)) as rt:
        assert rt.info()["eviction_policy"] == "reuse"
    monkeypatch.setenv("DMEM_EVICTION_POLICY", "mru")
    with pytest.raises(dmem.ConfigError) as e:
        dmem.Runtime(backend="host", host_capacity=8 * MiB, spill_dir=str(tmp_path))
    assert "DMEM_EVICTION_POLICY" in e.value.detail


# ---- dmem.dask's pass-through --------------------------------------------------------

def test_dask_passes_eviction_policy_through(tmp_path, monkeypatch):
    pytest.importorskip("distributed")
    from dmem.dask.cluster import worker_options
    from dmem.dask.data import RUNTIME_OPTIONS, DmemWorkerData
    from dmem.dask.worker import _parser

    monkeypatch.delenv("DMEM_EVICTION_POLICY", raising=False)
    assert "eviction_policy" in RUNTIME_OPTIONS
    # the options dmem.dask does not name itself, from the table
    own = {"backend", "device", "device_limit", "host_limit", "spill_dir", "host_capacity",
           "host_burst", "host_headroom"}
    assert set(RUNTIME_OPTIONS) == {r["keyword"] for r in ROWS if r["keyword"]} - own

    data = worker_options("host", eviction_policy="lru")["data"][1]
    assert data["eviction_policy"] == "lru"
    assert "eviction_policy" not in worker_options("host", eviction_policy=None)["data"][1]
    with pytest.raises(TypeError, match="unexpected keyword"):
        worker_options("host", no_such_option=1)

    args = _parser().parse_args(["tcp://127.0.0.1:1", "--eviction-policy", "lru"])
    assert args.rt_eviction_policy == "lru"
    with pytest.raises(SystemExit):
        _parser().parse_args(["tcp://127.0.0.1:1", "--eviction-policy", "mru"])

    d = DmemWorkerData(backend="host", device_memory_limit=4 * MiB, eviction_policy="lru",
                       spill_dir=str(tmp_path), worker_local_directory=str(tmp_path / "l"))
    try:
        assert d.runtime.info()["eviction_policy"] == "lru"
    finally:
        d.close()
        gc.collect()
        if d._owned:
            d.runtime.close()
    with pytest.raises(ValueError, match="eviction_policy"):
        DmemWorkerData(backend="host", device_memory_limit=4 * MiB, eviction_policy="mru",
                       worker_local_directory=str(tmp_path / "l2"))
    with pytest.raises(TypeError, match="unexpected keyword"):
        DmemWorkerData(backend="host", device_memory_limit=4 * MiB, no_such_option=1,
                       worker_local_directory=str(tmp_path / "l3"))


def test_local_cluster_passes_eviction_policy_to_its_workers(tmp_path, monkeypatch):
    pytest.importorskip("distributed")
    from distributed import Client

    from dmem.dask import LocalCluster

    monkeypatch.delenv("DMEM_EVICTION_POLICY", raising=False)
    with LocalCluster(n_workers=1, backend="host", device_memory_limit=4 * MiB,
                      eviction_policy="lru", spill_dir=str(tmp_path), memory_limit=0,
                      dashboard_address=None) as cluster:
        spec = next(iter(cluster.worker_spec.values()))
        assert spec["options"]["data"][1]["eviction_policy"] == "lru"
        with Client(cluster) as client:
            def policy(dask_worker):
                return dask_worker.data.runtime.info()["eviction_policy"]
            assert list(client.run(policy).values()) == ["lru"]


# ---- host_staging: an option added by a row of the table ---------------------------------

def staged(tmp_path, **kw):
    """A host runtime whose pinned pool holds 8 MiB of host tier plus the
    staging (64 MiB by default), asked for a reserve of 80 MiB."""
    return dmem.Runtime(backend="host", host_capacity=8 * MiB, host_limit=8 * MiB, host_burst=0.0,
                        host_reserve=80 * MiB, spill_dir=str(tmp_path), **kw)


def test_host_staging_keyword_environment_and_bad_values(tmp_path, monkeypatch):
    monkeypatch.delenv("DMEM_HOST_STAGING", raising=False)
    with pytest.raises(dmem.InvalidArgumentError, match="host_reserve"):
        staged(tmp_path)                           # 8 + 64 MiB < 80 MiB
    with staged(tmp_path, host_staging=80 * MiB):  # 8 + 80 MiB
        pass
    with staged(tmp_path, host_staging="80MiB"):
        pass
    monkeypatch.setenv("DMEM_HOST_STAGING", "80MiB")
    with staged(tmp_path):
        pass
    monkeypatch.setenv("DMEM_HOST_STAGING", "lots")
    with pytest.raises(dmem.ConfigError) as e:
        staged(tmp_path)
    assert "DMEM_HOST_STAGING" in e.value.detail
    monkeypatch.delenv("DMEM_HOST_STAGING")
    for bad, exc in (("lots", ValueError), (-1, ValueError), ("10%", ValueError),
                     (1.5, TypeError), (True, TypeError)):
        with pytest.raises(exc):
            staged(tmp_path, host_staging=bad)


def test_dask_passes_host_staging_through(tmp_path, monkeypatch):
    pytest.importorskip("distributed")
    from dmem.dask.cluster import worker_options
    from dmem.dask.data import RUNTIME_OPTIONS, DmemWorkerData
    from dmem.dask.worker import _parser

    monkeypatch.delenv("DMEM_HOST_STAGING", raising=False)
    assert "host_staging" in RUNTIME_OPTIONS
    assert worker_options("host", host_staging="80MiB")["data"][1]["host_staging"] == "80MiB"
    args = _parser().parse_args(["tcp://127.0.0.1:1", "--host-staging", "80MiB"])
    assert args.rt_host_staging == "80MiB"
    kw = dict(backend="host", device_memory_limit=8 * MiB, host_memory_limit=8 * MiB,
              host_burst=0.0, host_reserve=80 * MiB, spill_dir=str(tmp_path))
    with pytest.raises(dmem.InvalidArgumentError):
        DmemWorkerData(**kw, worker_local_directory=str(tmp_path / "a"))
    d = DmemWorkerData(**kw, host_staging="80MiB", worker_local_directory=str(tmp_path / "b"))
    try:
        assert d.runtime.info()["host_limit"] == 8 * MiB
    finally:
        d.close()
        gc.collect()
        if d._owned:
            d.runtime.close()


def test_dask_passes_spill_ahead_through(tmp_path, monkeypatch):
    pytest.importorskip("distributed")
    from dmem.dask.cluster import worker_options
    from dmem.dask.data import RUNTIME_OPTIONS, DmemWorkerData
    from dmem.dask.worker import _parser

    monkeypatch.delenv("DMEM_SPILL_AHEAD", raising=False)
    monkeypatch.delenv("DMEM_SPILL_AHEAD_TRIGGER", raising=False)
    assert {"spill_ahead", "spill_ahead_trigger"} <= set(RUNTIME_OPTIONS)
    data = worker_options("host", spill_ahead=False, spill_ahead_trigger="always")["data"][1]
    assert data["spill_ahead"] is False and data["spill_ahead_trigger"] == "always"
    args = _parser().parse_args(["tcp://127.0.0.1:1", "--spill-ahead", "80%,50%",
                                 "--spill-ahead-trigger", "always"])
    assert args.rt_spill_ahead == "80%,50%" and args.rt_spill_ahead_trigger == "always"
    with pytest.raises(SystemExit):  # not a choice
        _parser().parse_args(["tcp://127.0.0.1:1", "--spill-ahead-trigger", "never"])
    d = DmemWorkerData(backend="host", device_memory_limit=8 * MiB, spill_dir=str(tmp_path),
                       spill_ahead=args.rt_spill_ahead, worker_local_directory=str(tmp_path / "w"))
    try:
        s = d.runtime.stats()
        assert (s["spill_ahead_high"], s["spill_ahead_low"]) == (int(8 * MiB * 0.8),
                                                                 int(8 * MiB * 0.5))
    finally:
        d.close()
        gc.collect()
        if d._owned:
            d.runtime.close()
