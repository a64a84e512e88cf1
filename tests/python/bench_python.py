#!/usr/bin/env python3
"""Micro-benchmarks of the Python bridge (host backend unless --backend).

Prints one row per operation: time per call, and the ratio to a baseline
measured in the same process (allocating and dropping a bytearray of the same
size, i.e. the cheapest Python allocation of comparable work).

    PYTHONPATH=build/python python3 tests/python/bench_python.py [--backend host|cuda|auto]

Target on the development machine: alloc+free of a small buffer <= 1.5 us.
"""

import argparse
import gc
import time

import dmem


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


if __name__ == "__main__":
    main()
