#!/usr/bin/env python3
"""Allocation from Python through dmem's hooks against each library's own
allocator and RMM's hooks, on the GPU, in one run (issue 10):

  CuPy     cupy.cuda.alloc(n) (the MemoryPointer dropped at once) with the
           allocator set to dmem.cupy.allocator, CuPy's default pool, and
           rmm_cupy_allocator over an RMM pool;
  Numba    memalloc(n) + drop of DmemNumbaManager, Numba's own manager and
           RMM's RMMNumbaManager (each instantiated on the current context),
           and cuda.device_array(n) through Numba's own manager;
  PyTorch  torch.empty(n, dtype=uint8, device="cuda") + drop, and a small
           MLP's training loop (200 steps), through dmem.torch and through
           the caching allocator, each in its own process (an allocator is
           fixed once PyTorch has allocated).

Issue 24's hooks, each against the library's own allocator in the same run:

  RMM       rmm.DeviceBuffer(size=n, mr=...) + drop with dmem.rmm's
            DmemMemoryResource against an RMM pool (PoolMemoryResource over
            CudaMemoryResource, 1 GiB) and RMM's default CudaMemoryResource;
  cuda.core mr.allocate(n, stream=s) + close() with dmem.cuda_core's
            MemoryResource against the device's own (cuda.core's
            DeviceMemoryResource), and Device.allocate(n, stream=s) with
            each set as the device's resource (what numba-cuda 0.25+ calls
            for the device copy of a host array passed to a kernel);
  PyTorch   torch.empty(n) + drop inside torch.cuda.use_mem_pool(pool), with
            pool = dmem.torch.mempool() against torch.cuda.MemPool()
            (PyTorch's own allocator), in a process of its own.

The summary ("hooks") gives every hook's alloc+free pairs per second
through dmem and through the library's own allocator, and the cost ratio
(dmem time / own time: below 1, dmem is faster), also as RESULT lines
(RESULT hook_<hook>_<size>_pairs_per_s_dmem=..., ..._own=..., ..._ratio=...).
RMM's C++ resource is measured by bench_alloc (its "RMM hook" table).

Sizes 256 B, 1 MiB, 64 MiB. Each figure: the best of 5 runs of about 50 ms
after a warm-up (the MLP: the whole loop, best of 3); the CuPy allocators
are measured in three interleaved rounds and keep their best. Prints a table and the
ratios dmem / baseline (below 1: dmem is faster). Libraries that do not
import are left out. Usage, from the repository root after a `gpu` build:

    PYTHONPATH=build/gpu/python python3 bench/python_alloc.py [--quick]

Targets (issue 10): dmem.cupy.allocator <= CuPy's pool at each size; MLP
loop through dmem.torch within 10 % of the caching allocator;
DmemNumbaManager.memalloc >= 5x faster than Numba's own manager.
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import time

SIZES = (256, 1 << 20, 64 << 20)


def label(n):
    return f"{n} B" if n < 1024 else f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def per_call(fn, budget):
    """Seconds per call of fn(k) (a loop of k calls): k grows until a run
    takes budget/4 (warm-up), then the best of 5 runs that fill `budget`."""
    k = 1
    while True:
        t0 = time.perf_counter()
        fn(k)
        dt = time.perf_counter() - t0
        if dt >= budget / 4 or k >= 1 << 20:
            break
        k *= 4
    k = max(1, min(1 << 20, int(budget / max(dt / k, 1e-9))))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        fn(k)
        best = min(best, time.perf_counter() - t0)
    return best / k


def fix_numpy():
    import numpy as np

    if not hasattr(np, "row_stack"):  # numba-cuda 0.30 with numpy 2.5
        np.row_stack = np.vstack


def rmm_pool():
    try:
        import rmm

        rmm.reinitialize(pool_allocator=True)
        return rmm
    except Exception as e:  # noqa: BLE001
        print(f"rmm: not used ({type(e).__name__}: {e})")
        return None


# ---- CuPy ---------------------------------------------------------------------------------

def bench_cupy(budget, rmm):
    try:
        import cupy as cp
    except ImportError as e:
        print(f"cupy: not used ({e})")
        return {}
    import dmem.cupy

    allocators = {"dmem": dmem.cupy.allocator, "cupy pool": cp.get_default_memory_pool().malloc}
    if rmm is not None:
        from rmm.allocators.cupy import rmm_cupy_allocator

        allocators["rmm"] = rmm_cupy_allocator
    print(f"cupy: dmem.cupy.allocator takes the C path: {dmem.cupy.allocator.uses_c_api}")
    out = {}
    alloc = cp.cuda.alloc
    # Interleaved: three rounds, each allocator in turn, the best of all
    # rounds kept, so that no allocator gains from being measured first or
    # last (clock ramp, caches warmed by the one before).
    for _ in range(3):
        for name, a in allocators.items():
            cp.cuda.set_allocator(a)
            for n in SIZES:
                def loop(k, n=n):
                    for _ in range(k):
                        alloc(n)
                t = per_call(loop, budget)
                out[(name, n)] = min(out.get((name, n), t), t)
    cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)
    return out


def diagnose_cupy(budget):
    """Where one dmem.cupy.allocator alloc+free spends its time: the parts
    timed alone (ns per call)."""
    import cupy as cp
    import dmem
    import dmem.cupy
    from cupy.cuda import memory

    n = 256
    sp = cp.cuda.get_current_stream().ptr
    rt = dmem.default_runtime(cp.cuda.Device().id)
    alloc = dmem.cupy.allocator
    keep = rt.device_malloc(n, sp)
    parts = {}

    def direct(k):
        for _ in range(k):
            alloc(n)

    def raw(k):
        for _ in range(k):
            rt.device_malloc(n, sp)

    def wrap(k, p=keep.ptr):
        for _ in range(k):
            memory.MemoryPointer(memory.UnownedMemory(p, n, None, 0), 0)

    def cupy_alloc(k):
        for _ in range(k):
            cp.cuda.alloc(n)

    cp.cuda.set_allocator(alloc)
    for name, fn in (("allocator(n) called directly", direct),
                     ("rt.device_malloc(n, stream) + drop", raw),
                     ("MemoryPointer(UnownedMemory(...)) alone", wrap),
                     ("cupy.cuda.alloc(n) through dmem", cupy_alloc)):
        parts[name] = per_call(fn, budget)
    cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)
    keep.free()
    print(f"\ncupy diagnosis at {n} B (current stream ptr {sp}, "
          f"C path {alloc.uses_c_api}, runtime stats {rt.stats().get('pool_hits')} hits):")
    for name, t in parts.items():
        print(f"  {name:45s} {t * 1e9:8.0f} ns")


# ---- Numba --------------------------------------------------------------------------------

def bench_numba(budget, rmm):
    try:
        fix_numpy()
        from numba import cuda
        from numba.cuda.cudadrv import driver
    except ImportError as e:
        print(f"numba: not used ({e})")
        return {}
    import dmem.numba

    ctx = cuda.current_context()
    managers = {"dmem": dmem.numba.DmemNumbaManager(context=ctx),
                "numba": driver.NumbaCUDAMemoryManager(context=ctx)}
    if rmm is not None:
        from rmm.allocators.numba import RMMNumbaManager

        managers["rmm"] = RMMNumbaManager(context=ctx)
    out = {}
    for name, mm in managers.items():
        mm.initialize()
        for n in SIZES:
            def loop(k, n=n, m=mm.memalloc):
                for _ in range(k):
                    m(n)
            out[(name, n)] = per_call(loop, budget)
        mm.reset()
    for n in SIZES:  # the user's path through the process's manager (Numba's own)
        def loop(k, n=n):
            for _ in range(k):
                cuda.device_array(n, dtype="u1")
        out[("numba device_array", n)] = per_call(loop, budget)
    return out


# ---- PyTorch (one process per allocator) ------------------------------------------------------

def torch_worker(which, budget, steps):
    import torch

    if which == "dmem":
        import dmem.torch

        dmem.torch.use_dmem_for_torch()
    res = {}
    for n in SIZES:
        def loop(k, n=n):
            for _ in range(k):
                torch.empty(n, dtype=torch.uint8, device="cuda")
        res[str(n)] = per_call(loop, budget)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 10)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(256, 1024, device="cuda")
    y = torch.randint(0, 10, (256,), device="cuda")

    def train(k):
        for _ in range(k):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        torch.cuda.synchronize()

    train(20)  # warm-up (cuBLAS handles, Adam state)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        train(steps)
        best = min(best, time.perf_counter() - t0)
    res["mlp"] = best
    print(json.dumps(res))


def bench_torch(budget, steps):
    out = {}
    for which in ("dmem", "caching"):
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--torch-worker", which,
                            "--budget", str(budget), "--steps", str(steps)],
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["?"])[-1]
            print(f"torch ({which}): not used ({last})")
            return {}
        res = json.loads(r.stdout.strip().splitlines()[-1])
        for k, v in res.items():
            out[(which, k if k == "mlp" else int(k))] = v
    return out


# ---- issue 24's hooks: RMM, cuda.core (and numba-cuda's kernel-argument copies) ----------------

def bench_rmm_hook(budget):
    try:
        import rmm
        import rmm.mr
        import dmem.rmm

        mrs = {"dmem": dmem.rmm.DmemMemoryResource(0),
               "rmm pool": rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(),
                                                     initial_pool_size=1 << 30),
               "rmm cuda": rmm.mr.CudaMemoryResource()}
    except Exception as e:  # noqa: BLE001
        print(f"rmm hook: not used ({type(e).__name__}: {e})")
        return {}
    DeviceBuffer = rmm.DeviceBuffer
    out = {}
    for _ in range(3):  # interleaved rounds, best kept
        for name, mr in mrs.items():
            for n in SIZES:
                def loop(k, n=n, mr=mr):
                    for _ in range(k):
                        DeviceBuffer(size=n, mr=mr)
                t = per_call(loop, budget)
                out[(name, n)] = min(out.get((name, n), t), t)
    return out


def bench_cuda_core_hook(budget):
    try:
        from cuda.core import Device
        import dmem.cuda_core

        dev = Device(0)
        dev.set_current()
        own = dev.memory_resource
        mrs = {"dmem": dmem.cuda_core.MemoryResource(0), "cuda.core": own}
        s = dev.create_stream()
    except Exception as e:  # noqa: BLE001
        print(f"cuda.core hook: not used ({type(e).__name__}: {e})")
        return {}, {}
    direct, device = {}, {}
    for _ in range(3):
        for name, mr in mrs.items():
            dev.memory_resource = mr
            for n in SIZES:
                def loop(k, n=n, mr=mr):
                    for _ in range(k):
                        mr.allocate(n, stream=s).close(s)

                def via_device(k, n=n):
                    for _ in range(k):
                        dev.allocate(n, stream=s).close(s)
                t = per_call(loop, budget)
                direct[(name, n)] = min(direct.get((name, n), t), t)
                t = per_call(via_device, budget)
                device[(name, n)] = min(device.get((name, n), t), t)
    dev.memory_resource = own
    s.sync()
    return direct, device


def torch_mempool_worker(budget):
    import torch

    import dmem.torch

    pools = {"dmem": dmem.torch.mempool(0), "torch": torch.cuda.MemPool()}
    res = {}
    for _ in range(3):
        for name, pool in pools.items():
            with torch.cuda.use_mem_pool(pool):
                for n in SIZES:
                    def loop(k, n=n):
                        for _ in range(k):
                            torch.empty(n, dtype=torch.uint8, device="cuda")
                    t = per_call(loop, budget)
                    key = f"{name} {n}"
                    res[key] = min(res.get(key, t), t)
    print(json.dumps(res))


def bench_torch_mempool(budget):
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--torch-worker", "mempool",
                        "--budget", str(budget)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        print(f"torch mempool: not used ({last})")
        return {}
    res = json.loads(r.stdout.strip().splitlines()[-1])
    return {(k.split()[0], int(k.split()[1])): v for k, v in res.items()}


def hooks_summary(rows):
    """rows: (hook, results, dmem key, own key). Pairs per second and the
    cost ratio per size, as a table and RESULT lines."""
    rows = [r for r in rows if r[1]]
    if not rows:
        return
    print("\nhooks: alloc+free pairs per second through dmem and through the library's own "
          "allocator (same run); ratio = dmem time / own time (below 1: dmem faster)")
    print("| hook | own allocator | size | dmem pairs/s | own pairs/s | ratio |")
    print("|---|---|---|---|---|---|")
    results = []
    for hook, res, dk, ok in rows:
        slug = hook.lower().replace(" ", "_").replace(".", "_").replace("-", "_")
        for n in SIZES:
            d, o = res.get((dk, n)), res.get((ok, n))
            if d is None or o is None:
                continue
            print(f"| {hook} | {ok} | {label(n)} | {1 / d:,.0f} | {1 / o:,.0f} | {d / o:.2f} |")
            results += [f"RESULT hook_{slug}_{n}_pairs_per_s_dmem={1 / d:.0f}",
                        f"RESULT hook_{slug}_{n}_pairs_per_s_own={1 / o:.0f}",
                        f"RESULT hook_{slug}_{n}_ratio={d / o:.3f}"]
    print("\n".join(results))


# ---- report -------------------------------------------------------------------------------------

def table(title, res, dmem_key, others, unit=1e-9, unit_name="ns"):
    if not res:
        return
    cols = [dmem_key] + [o for o in others if any(k[0] == o for k in res)]
    print(f"\n{title} ({unit_name} per alloc+free; ratio = dmem / column)")
    print("| size | " + " | ".join(cols) + " | " +
          " | ".join(f"dmem/{c}" for c in cols[1:]) + " |")
    print("|" + "---|" * (1 + 2 * len(cols) - 1))
    for n in SIZES:
        if (dmem_key, n) not in res:
            continue
        vals = [res.get((c, n)) for c in cols]
        cells = [(f"{v / unit:.0f}" if v / unit >= 100 else f"{v / unit:.2g}")
                 if v is not None else "-" for v in vals]
        ratios = [f"{vals[0] / v:.2f}" if v else "-" for v in vals[1:]]
        print(f"| {label(n)} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs (CI smoke)")
    ap.add_argument("--budget", type=float, default=None)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--torch-worker", choices=("dmem", "caching", "mempool"))
    ap.add_argument("--only", choices=("cupy", "numba", "torch", "hooks"), action="append")
    ap.add_argument("--diagnose", action="store_true",
                    help="also time the parts of one dmem.cupy.allocator call")
    a = ap.parse_args()
    budget = a.budget or (0.01 if a.quick else 0.05)
    if a.torch_worker == "mempool":
        return torch_mempool_worker(budget)
    if a.torch_worker:
        return torch_worker(a.torch_worker, budget, a.steps)
    only = set(a.only or ("cupy", "numba", "torch", "hooks"))
    gc.disable()  # no collection pauses inside the timed loops (refcounting frees)
    rmm = rmm_pool() if only & {"cupy", "numba"} else None
    cres = bench_cupy(budget, rmm) if "cupy" in only else {}
    if a.diagnose and cres:
        diagnose_cupy(budget)
    nres = bench_numba(budget, rmm) if "numba" in only else {}
    rres = bench_rmm_hook(budget) if "hooks" in only else {}
    ccres, kres = bench_cuda_core_hook(budget) if "hooks" in only else ({}, {})
    gc.enable()
    tres = bench_torch(budget, 20 if a.quick else a.steps) if "torch" in only else {}
    mres = bench_torch_mempool(budget) if "hooks" in only else {}
    table("CuPy: cupy.cuda.alloc(n) with each allocator set", cres, "dmem", ["cupy pool", "rmm"])
    table("Numba: memalloc(n) of each EMM manager", nres, "dmem",
          ["numba", "rmm", "numba device_array"], unit=1e-6, unit_name="us")
    table("PyTorch: torch.empty(n, uint8, cuda)", tres, "dmem", ["caching"])
    if ("dmem", "mlp") in tres:
        d, c = tres[("dmem", "mlp")], tres[("caching", "mlp")]
        steps = 20 if a.quick else a.steps
        print(f"\nPyTorch MLP (1024-4096-4096-10, batch 256, Adam), {steps} steps: "
              f"dmem.torch {d * 1e3:.1f} ms, caching allocator {c * 1e3:.1f} ms, "
              f"ratio {d / c:.3f} (target <= 1.10)")
    table("RMM: rmm.DeviceBuffer(size=n, mr=...)", rres, "dmem", ["rmm pool", "rmm cuda"],
          unit=1e-6, unit_name="us")
    table("cuda.core: mr.allocate(n, stream=s).close(s)", ccres, "dmem", ["cuda.core"],
          unit=1e-6, unit_name="us")
    table("cuda.core: Device.allocate(n, stream=s).close(s) (numba-cuda's kernel-argument copies)",
          kres, "dmem", ["cuda.core"], unit=1e-6, unit_name="us")
    table("PyTorch: torch.empty(n) in torch.cuda.use_mem_pool(pool)", mres, "dmem", ["torch"])
    hooks_summary([("Numba EMM", nres, "dmem", "numba"),
                   ("Numba kernel-argument copies", kres, "dmem", "cuda.core"),
                   ("CuPy", cres, "dmem", "cupy pool"),
                   ("PyTorch global", tres, "dmem", "caching"),
                   ("PyTorch MemPool", mres, "dmem", "torch"),
                   ("RMM Python", rres, "dmem", "rmm pool"),
                   ("cuda.core", ccres, "dmem", "cuda.core")])
    verdicts = []
    for n in SIZES:
        if ("dmem", n) in cres and ("cupy pool", n) in cres:
            verdicts.append(f"cupy {label(n)} {'PASS' if cres[('dmem', n)] <= cres[('cupy pool', n)] else 'FAIL'}")
        if ("dmem", n) in nres and ("numba", n) in nres:
            verdicts.append(f"numba {label(n)} "
                            f"{'PASS' if nres[('numba', n)] >= 5 * nres[('dmem', n)] else 'FAIL'}")
    if ("dmem", "mlp") in tres:
        verdicts.append(f"torch mlp {'PASS' if tres[('dmem', 'mlp')] <= 1.10 * tres[('caching', 'mlp')] else 'FAIL'}")
    if verdicts:
        print("\ntargets: " + "; ".join(verdicts))


if __name__ == "__main__":
    main()
