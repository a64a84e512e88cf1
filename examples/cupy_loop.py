"""CuPy kernels over dmem buffers that hold twice the device limit.

    python3 examples/cupy_loop.py [--limit 4G] [--factor 2] [--buffer 256M]
                                  [--passes 3] [--depth 4] [--no-prefetch]

The buffers (factor x limit bytes in all) are locked in turn, each one
viewed as a CuPy float32 array that an elementwise kernel updates in place
(``x += 1``). The runtime spills buffers by its eviction policy to pinned
host memory as room runs short (stream-ordered: the loop does not wait
for them) and brings
each buffer back when it is locked; the loop prefetches the next ``depth``
buffers on a stream of their own (``Buffer.prefetch``), so that their
host->device copies run while the current kernel does and the spills of
older buffers run on the other copy engine at the same time. Each lock
ends with a synchronise of the kernel's stream, so the copies of the
buffers prefetched ahead are what keeps the link busy across it (the
default depth of 4 keeps 1 GiB in flight each way, a quarter of the 4 GiB
limit; docs/benchmarks.md has the depths measured).

Such a loop is bound by the PCIe link, not by the kernels. The time it
cannot beat is what moving the FEWEST bytes its access pattern allows
takes at the raw pinned copy bandwidth measured in this process (each
direction alone, and both at once): the fewest buffers any schedule must
bring in for this trace (``passes`` cyclic passes over the buffers) with
room for ``limit // buffer`` of them, by Belady's MIN (examples/
linkbound.py, starting from the best resident set), each load writing one
dirty buffer back. dmem's own byte counts (``bytes_spilled``,
``bytes_unspilled``) are printed against that minimum: moving more than
needed lowers the ratio instead of raising the bound. The script prints
the loop's time, the link-bound time and their ratio (1.0 = the minimum
bytes at the speed of the link), and the ratio for the bytes dmem did move
(how well it kept the link busy), plus ``RESULT name=value`` lines for
scripts/gpu-test: ``cupy_loop.ratio``, ``cupy_loop.ratio_moved``,
``cupy_loop.moved_over_min``, and ``cupy_loop.moved_over_pf``: dmem's bytes
over the fewest any schedule moves that honours every prefetch, from the
resident set the fill leaves (``linkbound.prefetch_trace``; 1.0 = the
eviction policy did the best it could: prefetching d ahead costs about d
of the places). It checks every buffer's first and last
element at the end; exit status 1 if one is wrong, 77 without CuPy or a
CUDA device.
"""
import argparse
import sys
import time

try:
    import cupy as cp
except ImportError:  # pragma: no cover
    print("SKIP: cupy is not installed")
    sys.exit(77)

import dmem
from linkbound import cyclic_trace, link_bound_seconds, min_transfers, prefetch_trace


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper().rstrip("B").rstrip("I")
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def anon_huge_gib():
    """(anonymous, in transparent huge pages) GiB of this process, or None
    off Linux: the pinned pool asks for huge pages (a hint); DMA from 4 KiB
    pages may run slower."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            kb = {ln.split(":")[0]: int(ln.split()[1]) for ln in f if ln.split()[-1:] == ["kB"]}
        return kb["Anonymous"] / 2**20, kb["AnonHugePages"] / 2**20
    except (OSError, KeyError, ValueError, IndexError):
        return None


def raw_bandwidth(nbytes, reps=5):
    """Pinned cudaMemcpyAsync GB/s: device->host, host->device, both at once."""
    dev = [cp.empty(nbytes, dtype=cp.uint8) for _ in range(2)]
    host = [cp.cuda.alloc_pinned_memory(nbytes) for _ in range(2)]
    s1 = cp.cuda.Stream(non_blocking=True)
    s2 = cp.cuda.Stream(non_blocking=True)
    d2h_kind = cp.cuda.runtime.memcpyDeviceToHost
    h2d_kind = cp.cuda.runtime.memcpyHostToDevice

    def timed(fn):
        best = []
        for _ in range(reps):
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            fn()
            s1.synchronize()
            s2.synchronize()
            best.append(time.perf_counter() - t0)
        best.sort()
        return best[len(best) // 2]

    def d2h():
        cp.cuda.runtime.memcpyAsync(host[0].ptr, dev[0].data.ptr, nbytes, d2h_kind, s1.ptr)

    def h2d():
        cp.cuda.runtime.memcpyAsync(dev[1].data.ptr, host[1].ptr, nbytes, h2d_kind, s2.ptr)

    def both():
        d2h()
        h2d()

    timed(both)  # warm-up
    t_d2h, t_h2d, t_both = timed(d2h), timed(h2d), timed(both)
    return nbytes / t_d2h * 1e-9, nbytes / t_h2d * 1e-9, 2 * nbytes / t_both * 1e-9


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", default="4G", help="dmem device limit (default 4G)")
    ap.add_argument("--factor", type=float, default=2.0, help="buffers' bytes / limit (2)")
    ap.add_argument("--buffer", default="256M", help="size of each buffer (256M)")
    ap.add_argument("--passes", type=int, default=3, help="passes over all buffers (3)")
    ap.add_argument("--depth", type=int, default=4, help="buffers prefetched ahead (4)")
    ap.add_argument("--no-prefetch", action="store_true", help="lock only, no prefetch")
    a = ap.parse_args()
    limit, size = parse_size(a.limit), parse_size(a.buffer)
    nbuf = max(2, int(a.factor * limit) // size)
    if cp.cuda.runtime.getDeviceCount() < 1:
        print("SKIP: no CUDA device")
        return 77

    d2h_bw, h2d_bw, both_bw = raw_bandwidth(min(size, 256 << 20))
    print("cupy_loop: raw pinned copies %.1f GB/s D2H, %.1f GB/s H2D, %.1f GB/s both at once"
          % (d2h_bw, h2d_bw, both_bw))

    rt = dmem.Runtime(device_limit=limit, backend="cuda")
    view = None
    try:
        cs = cp.cuda.Stream(non_blocking=True)
        ps = rt.stream()  # prefetches: a stream nobody waits for
        bufs = [rt.alloc(size) for _ in range(nbuf)]
        print("cupy_loop: %d buffers of %d MiB = %.2f GiB under a %.2f GiB limit, %d passes, "
              "prefetch %s" % (nbuf, size >> 20, nbuf * size / 2**30, limit / 2**30, a.passes,
                               "off" if a.no_prefetch else "depth %d" % a.depth))
        with cs:
            for i, b in enumerate(bufs):  # fill: element value = buffer index
                with b.lock(cs) as view:
                    cp.asarray(view).view(cp.float32).fill(float(i))
                # An array made from a view keeps the view as its owner, and
                # the view keeps the buffer locked while it lives: drop it.
                del view
        # The loop's kernel, compiled now: CuPy builds `x += 1.0` for float32
        # at its first use (NVRTC, unless its kernel cache on disk has it),
        # which the timed loop would count as time on the link. A fresh
        # machine's first run read 0.42-0.64 of link-bound, the next ones
        # 0.60-0.64 (docs/benchmarks.md).
        with cs:
            warm = cp.zeros(16, dtype=cp.float32)
            warm += 1.0
            del warm
        cs.synchronize()
        rt.poll()
        s0 = rt.stats()
        t0 = time.perf_counter()
        steps = []  # each lock's seconds, prefetch included: where a run lost its time
        with cs:
            for p in range(a.passes):
                for i, b in enumerate(bufs):
                    ts = time.perf_counter()
                    if not a.no_prefetch:
                        ahead = [bufs[(i + k) % nbuf] for k in range(1, a.depth + 1)]
                        try:
                            rt.prefetch(ahead, stream=ps)
                        except dmem.OutOfMemoryError:
                            pass  # a hint: the lock makes room
                    with b.lock(cs) as view:  # exit: synchronise cs, unlock
                        x = cp.asarray(view).view(cp.float32)
                        x += 1.0
                        del x
                    del view  # (the array's owner) the buffer can be spilled again
                    steps.append(time.perf_counter() - ts)
        elapsed = time.perf_counter() - t0
        rt.poll()
        s1 = rt.stats()
        spilled = s1["bytes_spilled"] - s0["bytes_spilled"]
        unspilled = s1["bytes_unspilled"] - s0["bytes_unspilled"]
        # the fewest bytes this loop's accesses must move under the limit
        slots = max(1, limit // size)
        loads, evictions = min_transfers(cyclic_trace(nbuf, a.passes), slots)
        min_in, min_out = loads * size, evictions * size
        # the fewest any schedule moves that honours every prefetch, from
        # the resident set the fill leaves (its last `slots` buffers): the
        # best the eviction policy can do for this loop
        depth = 0 if a.no_prefetch else a.depth
        fill = list(range(max(0, nbuf - slots), nbuf))
        pf_loads, pf_evictions = min_transfers(prefetch_trace(nbuf, a.passes, depth), slots,
                                               resident=fill)
        pf_bytes = (pf_loads + pf_evictions) * size
        moved_over_pf = (spilled + unspilled) / pf_bytes if pf_bytes else float("inf")
        bound = link_bound_seconds(min_out, min_in, d2h_bw, h2d_bw, both_bw)
        bound_moved = link_bound_seconds(spilled, unspilled, d2h_bw, h2d_bw, both_bw)
        moved_over_min = ((spilled + unspilled) / (min_in + min_out)
                          if min_in + min_out else float("inf"))
        bad = 0
        with cs:
            for i, b in enumerate(bufs):
                with b.lock(cs) as view:
                    x = cp.asarray(view).view(cp.float32)
                    want = float(i + a.passes)
                    if float(x[0]) != want or float(x[-1]) != want:
                        bad += 1
                    del x
                del view
        print("cupy_loop: moved %.2f GiB out, %.2f GiB in (prefetched %.2f GiB; ahead evictions "
              "%d, armed %d times, waits for room %d, %.3f s)"
              % (spilled / 2**30, unspilled / 2**30,
                 (s1["prefetch_bytes"] - s0["prefetch_bytes"]) / 2**30,
                 s1["ahead_evictions"] - s0["ahead_evictions"],
                 s1["ahead_arms"] - s0["ahead_arms"],
                 s1["room_waits"] - s0["room_waits"],
                 s1["seconds_waiting_for_room"] - s0["seconds_waiting_for_room"]))
        per = sorted(steps)
        worst = max(range(len(steps)), key=steps.__getitem__)
        huge = anon_huge_gib()
        if huge:
            print("cupy_loop: process memory %.2f GiB anonymous, %.2f GiB of it in huge pages"
                  % huge)
        print("cupy_loop: passes %s s; a lock's median %.2f ms, slowest %.2f ms (pass %d, buffer "
              "%d); pinned pool grew %d times (%d by its thread), pageable blocks %d"
              % (" ".join("%.3f" % sum(steps[k * nbuf:(k + 1) * nbuf]) for k in range(a.passes)),
                 per[len(per) // 2] * 1e3, steps[worst] * 1e3, worst // nbuf + 1, worst % nbuf,
                 s1["host_pool_grows"] - s0["host_pool_grows"],
                 s1["host_pool_background_grows"] - s0["host_pool_background_grows"],
                 s1["host_pageable_allocs"] - s0["host_pageable_allocs"]))
        print("cupy_loop: pinned pool held %.2f GiB (%.2f free) before the loop, %.2f GiB after"
              % (s0["host_pool_reserved"] / 2**30, s0["host_pool_free"] / 2**30,
                 s1["host_pool_reserved"] / 2**30))
        print("cupy_loop: minimum %.2f GiB out, %.2f GiB in (Belady MIN: %d loads with room for "
              "%d of %d buffers); dmem moved %.2fx the minimum"
              % (min_out / 2**30, min_in / 2**30, loads, slots, nbuf, moved_over_min))
        print("cupy_loop: fewest honouring the prefetches from the fill's resident set: %.2f GiB "
              "each way (%d loads); dmem moved %.2fx that"
              % (pf_loads * size / 2**30, pf_loads, moved_over_pf))
        ratio = bound / elapsed if elapsed > 0 else 0.0
        ratio_moved = bound_moved / elapsed if elapsed > 0 else 0.0
        print("cupy_loop: loop %.3f s, link-bound %.3f s (minimum bytes at the raw bandwidth): "
              "%.2f of link-bound; for the bytes dmem moved %.3f s: %.2f"
              % (elapsed, bound, ratio, bound_moved, ratio_moved))
        print("RESULT cupy_loop.ratio=%.4f" % ratio)
        print("RESULT cupy_loop.ratio_moved=%.4f" % ratio_moved)
        print("RESULT cupy_loop.moved_over_min=%.4f" % moved_over_min)
        print("RESULT cupy_loop.moved_over_pf=%.4f" % moved_over_pf)
        print("cupy_loop: %s" % ("OK" if bad == 0 else "FAILED (%d buffers wrong)" % bad))
        view = None  # the last view: its export holds the buffer
        for b in bufs:
            b.free()
        ps.close()
        return 0 if bad == 0 else 1
    finally:
        # A view whose __cuda_array_interface__ was taken keeps its buffer
        # locked while it lives (the `as` name outlives its block): drop the
        # last one before closing the runtime.
        view = None
        rt.close()


if __name__ == "__main__":
    sys.exit(main())
