#!/usr/bin/env python3
"""dmem.dask against dask-cuda, in alternated pairs: the command behind the
Dask figures of docs/benchmarks.md.

    python3 bench/dask_compare.py --preset two-gpu [--pairs 2]
    python3 bench/dask_compare.py --preset one-gpu [--pairs 2]
    python3 bench/dask_compare.py --pairs 3 -- --limit 4GB --host-limit 5G

Each pair is one run of examples/dask_cupy.py --cluster both (both clusters
in one process, one after the other, sums checked): the first pair starts
with dask-cuda, the next with dmem, and so on, so that neither cluster
always runs on a freshly warmed machine. The first run also warms the host
memory (--warm-host) as the published runs did. Arguments after `--` go to
dask_cupy.py as they are; a preset gives the settings of the published
figures:

    two-gpu  --limit 4GB --host-limit 6G --host-burst 0.2, warm 24G
             (every GPU of the machine: one worker per GPU)
    one-gpu  --limit 8GB --host-limit 9G, warm 40G, CUDA_VISIBLE_DEVICES=0
    defaults-one-gpu  --limit 8GB --threads 4 --memory-limit 100GB and
             nothing else (dmem's defaults), warm 40G, CUDA_VISIBLE_DEVICES=0
    defaults-two-gpu  the same on every GPU of the machine

Prints the device (nvidia-smi), each exact command, and a table: wall time
of each cluster, dask-cuda / dmem, peak worker RSS, and whether the sums
were exact; every run's output goes to --logs (default build/dask-compare).
Exit status: 0 when every run exited 0; otherwise the largest code (1 a
wrong sum, 2 a cluster that could not run: dask_cupy.py's codes), 3 when a
run printed no results.
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

PRESETS = {
    "two-gpu": (["--limit", "4GB", "--host-limit", "6G", "--host-burst", "0.2"], "24G", {}),
    "one-gpu": (["--limit", "8GB", "--host-limit", "9G"], "40G", {"CUDA_VISIBLE_DEVICES": "0"}),
    # Both clusters at their defaults (nothing of dmem's set): 4 threads,
    # Dask's memory_limit 100GB, 8GB of device memory per worker.
    "defaults-one-gpu": (["--limit", "8GB", "--threads", "4", "--memory-limit", "100GB"], "40G",
                         {"CUDA_VISIBLE_DEVICES": "0"}),
    "defaults-two-gpu": (["--limit", "8GB", "--threads", "4", "--memory-limit", "100GB"], "40G",
                         {}),
}


def device_names():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30)
        return [l.strip() for l in out.stdout.splitlines() if l.strip()] or ["none found"]
    except (OSError, subprocess.SubprocessError):
        return ["none found (no nvidia-smi)"]


def order(pair):
    """Which cluster runs first in pair `pair` (0-based): dask-cuda first in
    the first pair, then alternately."""
    return "dask-cuda" if pair % 2 == 0 else "dmem"


def summarize(results):
    """{cluster: result} from dask_cupy.py's --json list."""
    return {r["cluster"]: r for r in results}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    p.add_argument("--pairs", type=int, default=2, help="runs of both clusters (2)")
    p.add_argument("--warm-host", default=None,
                   help="bytes of host memory to touch before the first run (preset's)")
    p.add_argument("--logs", default=os.path.join(ROOT, "build", "dask-compare"))
    p.add_argument("--example", default=os.path.join(ROOT, "examples", "dask_cupy.py"),
                   help=argparse.SUPPRESS)  # a stand-in for the tests
    a = p.parse_args(argv)
    if a.pairs < 1:
        p.error("--pairs must be at least 1")
    settings, warm, env_extra = PRESETS.get(a.preset, ([], "0", {}))
    if a.warm_host is not None:
        warm = a.warm_host
    env = dict(os.environ)
    for k, v in env_extra.items():
        env.setdefault(k, v)
    os.makedirs(a.logs, exist_ok=True)
    print("dask_compare: device %s" % "; ".join(device_names()))
    if env_extra:
        print("dask_compare: environment %s"
              % " ".join("%s=%s" % (k, env[k]) for k in sorted(env_extra)))
    rows, worst = [], 0
    for pair in range(a.pairs):
        first = order(pair)
        out_json = os.path.join(a.logs, "pair%d.json" % (pair + 1))
        if os.path.exists(out_json):
            os.remove(out_json)
        cmd = [sys.executable, a.example, "--cluster", "both", "--first", first,
               "--json", out_json] + settings + extra
        if pair == 0 and warm not in ("0", ""):
            cmd += ["--warm-host", warm]
        print("dask_compare: pair %d: %s" % (pair + 1, " ".join(cmd)), flush=True)
        log = os.path.join(a.logs, "pair%d.log" % (pair + 1))
        with open(log, "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                cwd=ROOT).returncode
        results = None
        if os.path.exists(out_json):
            with open(out_json) as f:
                results = summarize(json.load(f))
        if results is None and rc == 0:
            rc = 3
        worst = max(worst, rc) if rc >= 0 else max(worst, 3)
        rows.append((pair + 1, first, rc, results, log))
    print()
    print("| pair | first | dmem | dask-cuda | dask-cuda / dmem | peak worker RSS dmem / "
          "dask-cuda | sums exact | exit |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for pair, first, rc, res, log in rows:
        res = res or {}
        d, c = res.get("dmem", {}), res.get("dask-cuda", {})

        def t(r):
            return "%.2f s" % r["total_s"] if "total_s" in r else r.get("error", "no result")

        ratio = ("%.2fx" % (c["total_s"] / d["total_s"])
                 if "total_s" in d and "total_s" in c else "")
        rss = ("%.2f / %.2f GiB" % (d["peak_worker_rss"] / 2**30, c["peak_worker_rss"] / 2**30)
               if "peak_worker_rss" in d and "peak_worker_rss" in c else "")
        exact = "/".join("yes" if r.get("correct") else "no" for r in (d, c))
        print("| %d | %s | %s | %s | %s | %s | %s | %d |" % (pair, first, t(d), t(c), ratio, rss,
                                                               exact, rc))
    print("dask_compare: %s; logs in %s"
          % ("OK" if worst == 0 else "FAILED (worst exit %d)" % worst, a.logs))
    return worst


if __name__ == "__main__":
    sys.exit(main())
