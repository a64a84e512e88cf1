#!/usr/bin/env python3
"""Micro-benchmarks of the Python bridge (host backend unless --backend).

Prints one row per operation: time per call, and the ratio to a baseline
measured in the same process (allocating and dropping a bytearray of the same
size, i.e. the cheapest Python allocation of comparable work).

Then, at 256 B, 1 MiB and 64 MiB, `rt.alloc(n).free()` beside
`cupy.cuda.alloc(n)` (CuPy's default memory pool; the MemoryPointer is freed
by dropping it), both in this process: ns per alloc+free pair and the ratio
dmem / CuPy (below 1: dmem is faster). Each figure is the best of 5 runs of
about 50 ms, after a warm-up. The CuPy column is skipped when cupy does not
import or has no device.

    PYTHONPATH=build/python python3 tests/python/bench_python.py [--backend host|cuda|auto]

On the GPU machine (gpu preset):

    PYTHONPATH=build/gpu/python python3 tests/python/bench_python.py --backend cuda

Target on the development machine: alloc+free of a small buffer <= 1.5 us;
from Python, dmem no slower than CuPy's own pool.
"""

import argparse
import gc
import time

import dmem

PAIR_SIZES = (256, 1 << 20, 64 << 20)


def per_call(fn, n, repeat=7):
    """Best of `repeat` runs of fn(n) (fn loops n times), in seconds per call."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(n)
        best = min(best, time.perf_counter() - t0)
    return best / n


def bench(backend="host", n=200_000, size=64):
    results = {}
    gc.disable()
    try:
        with dmem.Runtime(backend=backend, host_capacity=256 << 20) as rt:
            alloc = rt.alloc

            def alloc_free(k):
                for _ in range(k):
                    alloc(size)  # the Buffer is dropped at once: freed

            def baseline(k):
                for _ in range(k):
                    bytearray(size)

            b = rt.alloc(size)
            data = bytes(size)

            def lock_unlock(k):
                for _ in range(k):
                    with b.lock():
                        pass

            def write_read(k):
                for _ in range(k):
                    b.write(data)
                    b.read()

            def info(k):
                for _ in range(k):
                    b.state

            big = rt.alloc(1 << 20)

            def spill_unspill(k):
                for _ in range(k):
                    big.spill("host")
                    big.unspill()

            results["baseline bytearray+free"] = per_call(baseline, n)
            results["alloc+free"] = per_call(alloc_free, n)
            results["lock+unlock (view)"] = per_call(lock_unlock, n // 4)
            results["write+read 64 B"] = per_call(write_read, n // 10)
            results["buf.state"] = per_call(info, n)
            results["spill+unspill 1 MiB"] = per_call(spill_unspill, 200, repeat=3)
            results["_backend"] = rt.backend
    finally:
        gc.enable()
    return results


def per_call_timed(fn, budget=0.05, repeat=5):
    """Seconds per call of fn(k) (fn loops k times): k grows until one run
    takes a quarter of `budget` (this is the warm-up), then the best of
    `repeat` runs of the k that fills `budget`."""
    k = 1
    while True:
        t0 = time.perf_counter()
        fn(k)
        dt = time.perf_counter() - t0
        if dt >= budget / 4 or k >= 1 << 22:
            break
        k *= 4
    k = max(1, min(1 << 22, int(budget / max(dt / k, 1e-9))))
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(k)
        best = min(best, time.perf_counter() - t0)
    return best / k


def cupy_alloc():
    """cupy.cuda.alloc if CuPy imports and can allocate on a device, else
    (None, reason)."""
    try:
        import cupy
    except ImportError as e:
        return None, f"cupy not importable ({e})"
    try:
        cupy.cuda.alloc(256)
    except Exception as e:  # no device, no driver
        return None, f"cupy cannot allocate ({type(e).__name__}: {e})"
    return cupy.cuda.alloc, None


def bench_pairs(backend="host", sizes=PAIR_SIZES, budget=0.05):
    """{size: (dmem s per pair, CuPy s per pair or None)}, plus '_backend'
    and '_cupy' (None, or why the CuPy column is missing)."""
    results = {}
    alloc_cupy, why = cupy_alloc()
    gc.disable()
    try:
        with dmem.Runtime(backend=backend, host_capacity=256 << 20) as rt:
            alloc = rt.alloc
            for size in sizes:

                def dmem_pair(k, size=size):
                    for _ in range(k):
                        alloc(size).free()

                def cupy_pair(k, size=size):
                    for _ in range(k):
                        alloc_cupy(size)  # the MemoryPointer is dropped: back to the pool

                d = per_call_timed(dmem_pair, budget)
                c = per_call_timed(cupy_pair, budget) if alloc_cupy else None
                results[size] = (d, c)
            results["_backend"] = rt.backend
    finally:
        gc.enable()
    results["_cupy"] = why
    return results


def size_name(n):
    if n >= 1 << 20:
        return f"{n >> 20} MiB"
    if n >= 1 << 10:
        return f"{n >> 10} KiB"
    return f"{n} B"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="host", choices=["host", "cuda", "auto"])
    ap.add_argument("-n", type=int, default=200_000)
    args = ap.parse_args()
    r = bench(args.backend, args.n)
    base = r["baseline bytearray+free"]
    print(f"dmem Python bridge, backend {r.pop('_backend')}")
    print(f"{'operation':<26} {'us/call':>10} {'x baseline':>11}")
    for name, t in r.items():
        print(f"{name:<26} {t * 1e6:>10.3f} {t / base:>11.1f}")

    p = bench_pairs(args.backend)
    backend, why = p.pop("_backend"), p.pop("_cupy")
    print(f"\nalloc+free pair, ns: rt.alloc(n).free() (backend {backend}) vs "
          f"cupy.cuda.alloc(n) (CuPy's default pool)")
    print(f"{'size':<10} {'dmem':>10} {'CuPy':>10} {'dmem/CuPy':>10}")
    for size, (d, c) in p.items():
        cupy_ns = f"{c * 1e9:>10.0f}" if c else f"{'n/a':>10}"
        ratio = f"{d / c:>10.2f}" if c else f"{'n/a':>10}"
        print(f"{size_name(size):<10} {d * 1e9:>10.0f} {cupy_ns} {ratio}")
    if why:
        print(f"CuPy column skipped: {why}")


if __name__ == "__main__":
    main()
