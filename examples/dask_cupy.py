"""A dask.array workload on CuPy chunks at several times the workers' device
memory: dmem.dask.LocalCluster against dask-cuda's LocalCUDACluster.

    python3 examples/dask_cupy.py --cluster dmem --limit 8GB
    python3 examples/dask_cupy.py --cluster dask-cuda --limit 8GB
    python3 examples/dask_cupy.py --cluster both --limit 8GB --json out.json

The workload is issue 11's anchor: x, an n x n float64 array in c x c chunks
(default 40000^2 in 5000^2: 11.9 GiB), filled on the GPU; then
y = (x + x.T).persist() and y.sum(). With the default sizes, x and y are
23.8 GiB, 3x an 8 GB limit. Values are integers held as float64, so every sum
is exact. Checks:

- the big run's sum equals the sum computed block by block on one GPU with
  CuPy alone (nothing held, nothing spilled);
- a smaller run (--check-n, default 6000 in 1000^2 chunks), on the same
  cluster, equals the CuPy result element by element.

Prints, for each cluster: the time to fill x, the time for the transpose-add
and the sum, the bytes dmem moved across PCIe (dmem's statistics; NVML's PCIe
byte counters too, when the driver has them), and the peak RSS of the
worker processes. Needs a GPU, CuPy, dask and distributed (and dask-cuda for
the comparison). Exit status: 0 when every cluster asked for ran and got
exact sums; 1 when a sum is wrong; 2 when a cluster could not run (a
library missing, a cluster that failed to start or died: the error is
printed). bench/dask_compare.py runs this script in alternated pairs.
"""

import argparse
import json
import os
import resource
import sys
import time


def block(block_info=None):
    """One chunk of x: ((7 i + 3 j) mod 1000) at global (i, j), on the GPU."""
    import cupy

    (r0, r1), (c0, c1) = block_info[None]["array-location"]
    i = cupy.arange(r0, r1, dtype=cupy.int64)[:, None]
    j = cupy.arange(c0, c1, dtype=cupy.int64)[None, :]
    return ((7 * i + 3 * j) % 1000).astype(cupy.float64)


def make_x(n, c):
    import cupy
    import dask.array as da

    meta = cupy.empty((0, 0), dtype=cupy.float64)
    return da.map_blocks(block, chunks=((c,) * (n // c), (c,) * (n // c)), dtype="f8", meta=meta)


def reference_sum(n, c):
    """sum(x + x.T) = 2 sum(x), block by block with CuPy alone."""
    import cupy

    total = 0.0
    for r0 in range(0, n, c):
        i = cupy.arange(r0, r0 + c, dtype=cupy.int64)[:, None]
        j = cupy.arange(n, dtype=cupy.int64)[None, :]
        total += float(((7 * i + 3 * j) % 1000).astype(cupy.float64).sum())
    # the client's CuPy pool would otherwise keep these blocks on GPU 0
    # beside the worker's device limit
    cupy.get_default_memory_pool().free_all_blocks()
    return 2 * total


def worker_peak_rss(client):
    return client.run(lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def start_rss_sampler(client, period=0.02):
    """Start a thread in each worker that samples its RSS every `period` s
    and, at each new maximum, notes what the worker held: the keys in
    memory it computed and those it fetched from a peer (replicas), their
    bytes, how many of those replicas no task of the worker needs any more,
    and dmem's device and host tiers; and the most device memory the
    worker's GPU had in use at any sample (gpu_used_max: both clusters' use
    of the device, to compare with the host memory they held).
    worker_at_peak_rss() reads it: where a worker's peak host memory went."""
    def install(dask_worker, period=period):
        import threading

        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

        note = {"rss": 0, "gpu_used_max": 0}
        try:  # the whole device's memory in use (one worker per GPU)
            from cupy.cuda.runtime import memGetInfo
        except Exception:  # no CuPy, no GPU: the host backend
            memGetInfo = None

        def sample():
            while not note.get("stop"):
                if memGetInfo is not None:
                    free, total = memGetInfo()
                    note["gpu_used_max"] = max(note["gpu_used_max"], total - free)
                r = rss()
                if r > note["rss"]:
                    computed = fetched = cb = fb = unneeded = 0
                    for ts in list(dask_worker.state.tasks.values()):
                        if ts.state != "memory":
                            continue
                        if ts.run_spec is None:
                            fetched += 1
                            fb += ts.nbytes or 0
                            # no task of this worker needs it any more
                            unneeded += all(d.state in ("memory", "released", "forgotten",
                                                        "error") for d in list(ts.dependents))
                        else:
                            computed += 1
                            cb += ts.nbytes or 0
                    n = {"rss": r, "keys_computed": computed, "bytes_computed": cb,
                         "keys_fetched": fetched, "bytes_fetched": fb,
                         "keys_fetched_unneeded": unneeded}
                    rt = getattr(dask_worker.data, "runtime", None)
                    if rt is not None:
                        s = rt.stats()
                        n |= {k: s[k] for k in ("device_used", "device_reserved", "host_used",
                                                "host_pool_reserved", "host_pool_free",
                                                "host_pool_grows", "host_used_peak",
                                                "device_used_peak", "raw_used", "disk_used",
                                                "swaps", "spill_count", "unspill_count",
                                                "cancelled_spills", "prefetch_count")}
                    note.update(n)
                time.sleep(period)

        dask_worker._rss_note = note
        threading.Thread(target=sample, daemon=True, name="rss-sampler").start()

    client.run(install)


def worker_at_peak_rss(client):
    def get(dask_worker):
        note = getattr(dask_worker, "_rss_note", None)
        if note is None:
            return None
        note["stop"] = True
        return {k: v for k, v in note.items() if k != "stop"}

    return client.run(get)


def worker_dmem(client):
    def get(dask_worker):
        d = dask_worker.data
        if not hasattr(d, "runtime"):
            return None
        s = d.runtime.stats()
        # where the workers' host memory goes: the host tier, the pinned
        # pool holding it (and its growth), blocks that fell back to pageable
        return {k: s[k] for k in ("bytes_spilled", "bytes_unspilled", "spill_count",
                                  "unspill_count", "device_used", "host_used", "disk_used",
                                  "host_pool_reserved", "host_pool_grows",
                                  "host_pool_background_grows", "host_pageable_used",
                                  "host_pageable_allocs", "room_waits",
                                  "seconds_waiting_for_room", "seconds_spilling",
                                  "seconds_unspilling", "host_to_disk_bytes",
                                  "seconds_host_to_disk", "disk_to_device_bytes",
                                  "seconds_disk_to_device")} | {
            "adopted": d.counts["adopted"], "copied": d.counts["copied"],
            **{k: round(v, 3) for k, v in _ser().timing.items()}}

    return client.run(get)


def _ser():
    from dmem.dask import serialize

    return serialize


def worker_transfers(client):
    """What the workers fetched from each other (distributed's
    transfer_incoming_log): fetches and bytes summed over the workers, and
    the busiest worker's seconds with at least one fetch in flight."""
    def get(dask_worker):
        log = list(dask_worker.transfer_incoming_log)
        spans = sorted((e["start"], e["stop"]) for e in log)
        busy, end = 0.0, None
        for a, b in spans:
            if end is None or a > end:
                busy += b - a
                end = b
            elif b > end:
                busy += b - end
                end = b
        return {"bytes": sum(e["total"] for e in log), "count": len(log), "busy_s": busy}

    per = client.run(get)
    return {"bytes": sum(v["bytes"] for v in per.values()),
            "count": sum(v["count"] for v in per.values()),
            "busy_s": max((v["busy_s"] for v in per.values()), default=0.0)}


def pcie_bytes():
    """(tx, rx) bytes of GPU 0's PCIe counters, or None."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        tx = getattr(pynvml, "NVML_FI_DEV_PCIE_COUNT_TX_BYTES", None)
        rx = getattr(pynvml, "NVML_FI_DEV_PCIE_COUNT_RX_BYTES", None)
        if tx is None or rx is None:
            return None
        vals = pynvml.nvmlDeviceGetFieldValues(h, [tx, rx])
        if any(v.nvmlReturn != 0 for v in vals):
            return None
        return vals[0].value.ullVal, vals[1].value.ullVal
    except Exception:
        return None


def warm_host(nbytes):
    """Touch nbytes of fresh host memory in a child process, then let it go.
    On the lent VMs the guest's memory grows on first use (a few GB/s), so
    whichever cluster runs first would pay for that growth; after this
    neither does."""
    import subprocess

    code = ("import mmap, sys\n"
            "n = int(sys.argv[1]); m = mmap.mmap(-1, n)\n"
            "for o in range(0, n, 1 << 30):\n"
            "    m[o:o + min(1 << 30, n - o)] = bytes(min(1 << 30, n - o))\n")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, str(nbytes)], check=True)
    return time.perf_counter() - t0


def start(kind, n_workers, limit, threads, spill_dir, host_limit=None, host_burst=None,
          memory_limit=0, host_headroom=None):
    if kind == "dmem":
        from dmem.dask import LocalCluster

        return LocalCluster(n_workers=n_workers, device_memory_limit=limit,
                            host_memory_limit=host_limit, host_burst=host_burst,
                            host_headroom=host_headroom, spill_dir=spill_dir,
                            threads_per_worker=threads, dashboard_address=None,
                            memory_limit=memory_limit)
    from dask_cuda import LocalCUDACluster

    return LocalCUDACluster(n_workers=n_workers, device_memory_limit=limit,
                            threads_per_worker=threads, dashboard_address=None,
                            local_directory=spill_dir, memory_limit=memory_limit)


def run(kind, args):
    import cupy
    from distributed import Client, wait

    out = {"cluster": kind}
    t_start = time.perf_counter()
    with start(kind, args.workers, args.limit, args.threads, args.spill_dir,
               args.host_limit, args.host_burst, args.memory_limit,
               args.host_headroom) as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(args.workers or 1)
        out["start_s"] = time.perf_counter() - t_start
        out["workers"] = len(client.scheduler_info()["workers"])
        # the smaller exact run, element by element
        xs = make_x(args.check_n, args.check_c)
        small = (xs + xs.T).compute()
        i = cupy.arange(args.check_n, dtype=cupy.int64)
        ref = ((7 * i[:, None] + 3 * i[None, :]) % 1000).astype(cupy.float64)
        out["small_exact"] = bool(cupy.array_equal(small, ref + ref.T))
        del small, ref
        start_rss_sampler(client)
        pcie0 = pcie_bytes()
        t0 = time.perf_counter()
        x = make_x(args.n, args.c).persist()
        wait(x)
        t1 = time.perf_counter()
        y = (x + x.T).persist()
        wait(y)
        total = float(y.sum().compute())
        t2 = time.perf_counter()
        pcie1 = pcie_bytes()
        out["fill_s"] = t1 - t0
        out["transpose_add_sum_s"] = t2 - t1
        out["total_s"] = t2 - t0
        out["sum"] = total
        out["peak_worker_rss"] = max(worker_peak_rss(client).values())
        out["at_peak_rss"] = worker_at_peak_rss(client)
        out["dmem"] = worker_dmem(client)
        out["transfers"] = worker_transfers(client)
        if pcie0 and pcie1:
            # NVML's counters are narrower than the bytes a run moves and
            # wrap (seen on the lent H200s): a negative difference says so,
            # and no difference says how often they wrapped
            tx, rx = pcie1[0] - pcie0[0], pcie1[1] - pcie0[1]
            out["pcie_tx_bytes"] = tx if tx >= 0 and rx >= 0 else None
            out["pcie_rx_bytes"] = rx if tx >= 0 and rx >= 0 else None
        del x, y
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cluster", choices=("dmem", "dask-cuda", "both"), default="dmem")
    p.add_argument("--limit", default="8GB", help="device memory limit per worker")
    p.add_argument("--workers", type=int, default=None, help="default: one per GPU")
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--host-limit", default=None,
                   help="dmem's host tier per worker (host_memory_limit; past it, least "
                        "recently used buffers go to disk in the background); default none")
    p.add_argument("--host-burst", type=float, default=None,
                   help="how far past the host limit (a fraction of it) dmem's host tier may "
                        "grow while it is pushed down to disk; default dmem's 0.5")
    p.add_argument("--host-headroom", default=None,
                   help="the most free pinned memory dmem's pinned pool keeps ahead of spills "
                        "(bytes, '256MiB'); default dmem.dask's: DMEM_HOST_HEADROOM, else 0")
    p.add_argument("--memory-limit", default="0",
                   help="Dask's memory_limit per worker, for both clusters (default 0: none; "
                        "dmem derives its host limit from it, docs/dask.md)")
    p.add_argument("--n", type=int, default=40000)
    p.add_argument("--c", type=int, default=5000)
    p.add_argument("--check-n", type=int, default=6000)
    p.add_argument("--check-c", type=int, default=1000)
    p.add_argument("--spill-dir", default=os.environ.get("TMPDIR", "/tmp"))
    p.add_argument("--json", default=None, help="write the results here too")
    p.add_argument("--warm-host", default="0",
                   help="touch this many bytes of host memory first (K/M/G suffix), so that "
                        "neither cluster pays for the VM's memory growing")
    p.add_argument("--first", choices=("dmem", "dask-cuda"), default="dmem",
                   help="with --cluster both: which runs first")
    args = p.parse_args(argv)
    if args.n % args.c or args.check_n % args.check_c:
        p.error("n must be a multiple of c, check-n of check-c")
    import re

    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMG]?)(i?B)?\s*", args.warm_host, re.I)
    if not m:
        p.error(f"--warm-host {args.warm_host!r}: expected bytes with an optional K/M/G suffix")
    warm = int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2).upper()])
    if warm:
        print(f"warmed {warm / 2**30:.1f} GiB of host memory in {warm_host(warm):.1f} s", flush=True)
    want = reference_sum(args.n, args.c)
    kinds = ("dmem", "dask-cuda") if args.cluster == "both" else (args.cluster,)
    if args.cluster == "both" and args.first == "dask-cuda":
        kinds = kinds[::-1]
    results, wrong, failed = [], False, False
    for kind in kinds:
        try:
            r = run(kind, args)
        except Exception as e:  # a missing library, a cluster that failed to start or died
            r = {"cluster": kind, "error": f"cannot run: {type(e).__name__}: {e}"}
        r["expected_sum"] = want
        r["correct"] = r.get("sum") == want and r.get("small_exact", False)
        failed |= "error" in r
        wrong |= "error" not in r and not r["correct"]
        results.append(r)
        print(json.dumps(r, indent=1, default=str), flush=True)
    if len(results) == 2 and all("total_s" in r for r in results):
        d, c = sorted(results, key=lambda r: r["cluster"] != "dmem")
        print(f"dask-cuda / dmem wall time: {c['total_s'] / d['total_s']:.2f}x; "
              f"peak worker RSS dmem {d['peak_worker_rss'] / 2**30:.2f} GiB, "
              f"dask-cuda {c['peak_worker_rss'] / 2**30:.2f} GiB; cluster start dmem "
              f"{d['start_s']:.1f} s, dask-cuda {c['start_s']:.1f} s")
        for r in (d, c):
            t = r.get("transfers") or {}
            if t.get("count"):
                print(f"{r['cluster']}: {t['count']} fetches between workers, "
                      f"{t['bytes'] / 1e9:.2f} GB, in flight {t['busy_s']:.2f} s "
                      f"(busiest worker)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    if wrong:
        print("dask_cupy: WRONG RESULT")
        return 1
    if failed:
        print("dask_cupy: FAILED (%s could not run)"
              % ", ".join(r["cluster"] for r in results if "error" in r))
        return 2
    print("dask_cupy: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
