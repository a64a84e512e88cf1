#!/usr/bin/env python3
"""The CPU side of dmem.cupy.allocator without a GPU, A/B between builds.

One alloc+free is `alloc(n)` with the MemoryPointer dropped at once, where
alloc is dmem._dmem.CupyAllocator over CuPy's real UnownedMemory and
MemoryPointer classes (CuPy imports without a driver) and the default
runtime (the host backend on a machine without a GPU). CuPy's device and
stream getters need a driver, so C stand-ins take their place: capsules of
the signatures CuPy exports, pointing at libm's fegetround (returns 0, no
system call). The CUDA calls of the real getters are left out; everything
dmem does is in.

Each build runs in its own processes, interleaved (A B B A ...), so that
a noisy neighbour hits every build alike; each process reports the median
of 5 rounds of 100,000 calls per size; printed: the median over processes
[min-max], ns per alloc+free at 256 B, 1 MiB, 64 MiB. A build is a
directory with python/ (the dmem package) and libdmem.so.0 (in itself or
in lib/), e.g. build/default. Needs CuPy (cupy-cuda12x / cupy-cuda13x) on
PYTHONPATH or installed:

    python3 bench/cupy_alloc_host.py build/base build/default [--procs 8]
"""

import argparse
import ctypes
import ctypes.util
import os
import statistics
import subprocess
import sys
import time

SIZES = (256, 1 << 20, 64 << 20)


def child(n, rounds):
    import dmem._dmem as D
    from cupy.cuda import memory

    fn = ctypes.cast(ctypes.CDLL(ctypes.util.find_library("m")).fegetround, ctypes.c_void_p).value
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    names = [b"int (int __pyx_skip_dispatch)", b"intptr_t (void)"]  # alive with the capsules
    dev, stream = (new(fn, name, None) for name in names)
    alloc = D.CupyAllocator(memory.UnownedMemory, memory.MemoryPointer, dev, stream,
                            lambda: None, None)
    assert alloc.uses_c_api and alloc(256).mem.size == 256
    out = []
    for size in SIZES:
        per = []
        for _ in range(rounds):
            t = time.perf_counter_ns()
            for _ in range(n):
                alloc(size)
            per.append((time.perf_counter_ns() - t) / n)
        out.append(statistics.median(per))
    print(" ".join(f"{x:.1f}" for x in out))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("builds", nargs="*")
    ap.add_argument("--procs", type=int, default=6, help="processes per build")
    ap.add_argument("--calls", type=int, default=100000)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.calls, 5)
    res = {b: [] for b in a.builds}
    for i in range(a.procs):
        for b in a.builds if i % 2 == 0 else a.builds[::-1]:
            lib = os.path.join(b, "lib") if os.path.isdir(os.path.join(b, "lib")) else b
            env = dict(os.environ, OPENBLAS_NUM_THREADS="1",
                       PYTHONPATH=os.pathsep.join([os.path.join(b, "python"),
                                                   os.environ.get("PYTHONPATH", "")]),
                       LD_LIBRARY_PATH=os.path.abspath(lib))
            r = subprocess.run([sys.executable, __file__, "--child", "--calls", str(a.calls)],
                               env=env, capture_output=True, text=True)
            if r.returncode:
                sys.exit(f"{b}: {r.stderr}")
            res[b].append([float(x) for x in r.stdout.split()])
    print("ns per alloc+free, median [min-max] over", a.procs, "processes:",
          ", ".join(f"{s} B" for s in SIZES))
    for b, rows in res.items():
        cols = list(zip(*rows))
        print(f"{b:24s}", "  ".join(f"{statistics.median(c):5.0f} [{min(c):.0f}-{max(c):.0f}]"
                                    for c in cols))


if __name__ == "__main__":
    main()
