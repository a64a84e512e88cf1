"""bench/dask_compare.py (the Dask comparison's driver) and the exit status
of examples/dask_cupy.py, on the host: a stand-in for the example records
the order of the clusters; dask_cupy.main runs with its cluster runs
replaced, one side failing."""

import json
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import dask_cupy  # noqa: E402

FAKE = r'''
import json, os, sys
a = sys.argv[1:]
first = a[a.index("--first") + 1]
out = a[a.index("--json") + 1]
with open(os.environ["FAKE_RECORD"], "a") as f:
    f.write(json.dumps(a) + "\n")
fail = os.environ.get("FAKE_FAIL") == first
res = [{"cluster": "dmem", "total_s": 2.0, "peak_worker_rss": 2 << 30, "correct": True},
       {"cluster": "dask-cuda", "total_s": 5.0, "peak_worker_rss": 3 << 30,
        "correct": True}]
if fail:
    res[1] = {"cluster": "dask-cuda", "error": "cannot run: boom", "correct": False}
with open(out, "w") as f:
    json.dump(res, f)
sys.exit(2 if fail else 0)
'''


def run_driver(tmp_path, *args, env_extra=None):
    fake = tmp_path / "fake_dask_cupy.py"
    fake.write_text(FAKE)
    record = tmp_path / "record"
    env = dict(os.environ, FAKE_RECORD=str(record), **(env_extra or {}))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "dask_compare.py"),
                        "--example", str(fake), "--logs", str(tmp_path / "logs")] + list(args),
                       capture_output=True, text=True, env=env)
    calls = [json.loads(l) for l in record.read_text().splitlines()] if record.exists() else []
    return p, calls


def test_pairs_alternate_dask_cuda_first(tmp_path):
    p, calls = run_driver(tmp_path, "--preset", "two-gpu", "--pairs", "3")
    assert p.returncode == 0, p.stdout + p.stderr
    firsts = [c[c.index("--first") + 1] for c in calls]
    assert firsts == ["dask-cuda", "dmem", "dask-cuda"]
    for c in calls:  # the published settings, both clusters in each run
        assert c[c.index("--cluster") + 1] == "both"
        assert c[c.index("--limit") + 1] == "4GB"
        assert c[c.index("--host-limit") + 1] == "6G"
        assert c[c.index("--host-burst") + 1] == "0.2"
    # the host is warmed before the first run only
    assert "--warm-host" in calls[0] and all("--warm-host" not in c for c in calls[1:])
    assert "| 1 | dask-cuda | 2.00 s | 5.00 s | 2.50x |" in p.stdout
    assert "dask_compare: OK" in p.stdout


def test_extra_arguments_pass_through(tmp_path):
    p, calls = run_driver(tmp_path, "--pairs", "1", "--", "--limit", "1GB", "--n", "4000")
    assert p.returncode == 0
    assert calls[0][-4:] == ["--limit", "1GB", "--n", "4000"]


def test_a_side_that_fails_fails_the_driver(tmp_path):
    p, _ = run_driver(tmp_path, "--pairs", "2", env_extra={"FAKE_FAIL": "dmem"})
    assert p.returncode == 2
    assert "cannot run: boom" in p.stdout
    assert "FAILED" in p.stdout


def fake_run(outcomes):
    def run(kind, args):
        o = outcomes[kind]
        if isinstance(o, Exception):
            raise o
        return {"cluster": kind, "sum": o, "small_exact": True, "total_s": 1.0, "start_s": 0.1,
                "peak_worker_rss": 1}
    return run


def test_dask_cupy_exits_nonzero_when_a_cluster_fails_to_start(monkeypatch, capsys):
    monkeypatch.setattr(dask_cupy, "reference_sum", lambda n, c: 42.0)
    monkeypatch.setattr(dask_cupy, "run", fake_run(
        {"dmem": 42.0, "dask-cuda": RuntimeError("Worker failed to start")}))
    assert dask_cupy.main(["--cluster", "both"]) == 2
    out = capsys.readouterr().out
    assert "FAILED (dask-cuda could not run)" in out
    assert "dask_cupy: OK" not in out


def test_dask_cupy_missing_library_is_a_failure(monkeypatch):
    monkeypatch.setattr(dask_cupy, "reference_sum", lambda n, c: 42.0)
    monkeypatch.setattr(dask_cupy, "run", fake_run(
        {"dmem": 42.0, "dask-cuda": ImportError("No module named 'dask_cuda'")}))
    assert dask_cupy.main(["--cluster", "both"]) == 2


def test_dask_cupy_wrong_sum_is_1(monkeypatch):
    monkeypatch.setattr(dask_cupy, "reference_sum", lambda n, c: 42.0)
    monkeypatch.setattr(dask_cupy, "run", fake_run({"dmem": 41.0, "dask-cuda": 42.0}))
    assert dask_cupy.main(["--cluster", "both"]) == 1


def test_dask_cupy_ok_is_0(monkeypatch):
    monkeypatch.setattr(dask_cupy, "reference_sum", lambda n, c: 42.0)
    monkeypatch.setattr(dask_cupy, "run", fake_run({"dmem": 42.0, "dask-cuda": 42.0}))
    assert dask_cupy.main(["--cluster", "both"]) == 0
