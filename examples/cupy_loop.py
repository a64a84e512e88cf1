"""CuPy kernels over dmem buffers that hold twice the device limit.

    python3 examples/cupy_loop.py [--limit 4G] [--factor 2] [--buffer 256M]
                                  [--passes 3] [--depth 4] [--no-prefetch]
                                  [--repeat 3] [--beside loop|pass]

The buffers (factor x limit bytes in all) are locked in turn, each one
viewed as a CuPy float32 array that an elementwise kernel updates in place
(``x += 1``). The runtime spills buffers by its eviction policy to pinned
host memory as room runs short (stream-ordered: the loop does not wait
for them) and brings each buffer back when it is locked; the loop
prefetches the next ``depth`` buffers it will use on a stream of their own
(``Buffer.prefetch``), so that their host->device copies run while the
current kernel does and the spills of older buffers run on the other copy
engine at the same time. Each lock ends with a synchronise of the kernel's
stream, so the copies of the buffers prefetched ahead are what keeps the
link busy across it (the default depth of 4 keeps 1 GiB in flight each
way, a quarter of the 4 GiB limit; docs/benchmarks.md has the depths
measured).

Such a loop is bound by the PCIe link, not by the kernels. The time it
cannot beat is what moving the FEWEST bytes its access pattern allows
takes at the raw pinned copy bandwidth (each direction alone, and both at
once): the fewest buffers any schedule must bring in for this trace
(``passes`` cyclic passes over the buffers) with room for ``limit //
buffer`` of them, by Belady's MIN (examples/linkbound.py, starting from
the best resident set), each load writing one dirty buffer back. dmem's
own byte counts (``bytes_spilled``, ``bytes_unspilled``) are printed
against that minimum: moving more than needed lowers the ratio instead of
raising the bound.

The timed loop runs ``repeat`` times, its passes back to back. Before
the first loop and after each, a stretch of raw copies of about the bytes
a loop moves (both ways at once, back to back on two streams, timed as a
whole) gives the bandwidth the loop is timed against: the mean of the
stretches just before and just after it. The lent machines' link drifts
between about 65 and 95 GB/s both ways from one tenth of a second to the
next (docs/benchmarks.md), and a median of short copies before the loop
(the ``raw pinned copies`` line, which bounds moves that are not
symmetric) leaves out the slow stretches a loop of half a second runs
into. ``--beside pass`` puts a stretch beside each pass instead, raw first
and the pass first in turn: closer in time, but each pass then starts with
an idle link, as a loop does once. The clock stops when the device is
idle, so every byte counted was moved in the time, and the last pass
prefetches nothing past its last lock. The first loop also pays for the
pinned pool's growth to the loop's working set (printed per loop).

For each loop the script prints its time, the link-bound time and their
ratio (1.0 = the minimum bytes at the speed of the link), and the ratio
for the bytes dmem did move (how well it kept the link busy). Then
``RESULT name=value`` lines for scripts/gpu-test, the median over the
loops unless named otherwise: ``cupy_loop.ratio``,
``cupy_loop.ratio_moved``, ``cupy_loop.ratio_moved_first`` (the first
loop's), ``cupy_loop.moved_over_min``, and ``cupy_loop.moved_over_pf``:
the first loop's bytes over the fewest any schedule moves that honours
every prefetch, from the resident set the fill leaves
(``linkbound.prefetch_trace``; 1.0 = the eviction policy did the best it
could: prefetching d ahead costs about d of the places). It checks every
buffer's first and last element at the end; exit status 1 if one is
wrong, 77 without CuPy or a CUDA device.
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


class RawLink:
    """Pinned cudaMemcpyAsync GB/s (device->host, host->device, both at
    once) between two preallocated device arrays and two pinned host
    buffers of `nbytes`: the baseline, measured again beside each pass of
    a timed loop (the lent machines' link moves between about 65 and 95
    GB/s both ways from one tenth of a second to the next)."""

    def __init__(self, nbytes, reps=5):
        self.nbytes, self.reps = nbytes, reps
        self.dev = [cp.empty(nbytes, dtype=cp.uint8) for _ in range(2)]
        self.host = [cp.cuda.alloc_pinned_memory(nbytes) for _ in range(2)]
        self.s1 = cp.cuda.Stream(non_blocking=True)
        self.s2 = cp.cuda.Stream(non_blocking=True)

    def _d2h(self):
        cp.cuda.runtime.memcpyAsync(self.host[0].ptr, self.dev[0].data.ptr, self.nbytes,
                                    cp.cuda.runtime.memcpyDeviceToHost, self.s1.ptr)

    def _h2d(self):
        cp.cuda.runtime.memcpyAsync(self.dev[1].data.ptr, self.host[1].ptr, self.nbytes,
                                    cp.cuda.runtime.memcpyHostToDevice, self.s2.ptr)

    def _both(self):
        self._d2h()
        self._h2d()

    def _timed(self, fn):
        times = []
        for _ in range(self.reps):
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            fn()
            self.s1.synchronize()
            self.s2.synchronize()
            times.append(time.perf_counter() - t0)
        times.sort()
        return times[len(times) // 2]

    def measure(self):
        """(d2h, h2d, both) GB/s, each the median of `reps` copies."""
        self._timed(self._both)  # warm-up
        n = self.nbytes
        return (n / self._timed(self._d2h) * 1e-9, n / self._timed(self._h2d) * 1e-9,
                2 * n / self._timed(self._both) * 1e-9)

    def stream(self, each_way):
        """GB/s both ways at once over a stretch as long as a pass:
        `each_way` bytes each way as back-to-back copies of nbytes on the
        two streams, timed as a whole (a slow tenth of a second on the
        link counts here as it does in the loop; a median of short copies
        leaves it out)."""
        k = max(1, -(-each_way // self.nbytes))
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(k):
            self._both()
        self.s1.synchronize()
        self.s2.synchronize()
        return 2 * k * self.nbytes / (time.perf_counter() - t0) * 1e-9


def timed_passes(rt, bufs, cs, ps, first, count, passes, depth):
    """Passes first .. first + count - 1 of a loop of `passes` passes over
    `bufs`, back to back: before each lock, a prefetch of the next `depth`
    buffers the loop will still use (none past its last lock: a loop that
    ends does not fetch for a pass that never comes); each lock runs
    `x += 1` on cs and ends with cs synchronised. The clock stops once the
    device is idle, so that every byte the passes moved (their prefetches
    for the next pass included) is in their time. Returns (seconds, each
    lock's seconds, prefetch included)."""
    nbuf, n = len(bufs), passes * len(bufs)
    steps = []
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    with cs:
        for p in range(first, first + count):
            for i, b in enumerate(bufs):
                ts = time.perf_counter()
                ahead = [bufs[(i + k) % nbuf] for k in range(1, depth + 1)
                         if p * nbuf + i + k < n]
                if ahead:
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
    cp.cuda.Device().synchronize()  # the last spills and prefetches
    return time.perf_counter() - t0, steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", default="4G", help="dmem device limit (default 4G)")
    ap.add_argument("--factor", type=float, default=2.0, help="buffers' bytes / limit (2)")
    ap.add_argument("--buffer", default="256M", help="size of each buffer (256M)")
    ap.add_argument("--passes", type=int, default=3, help="passes over all buffers (3)")
    ap.add_argument("--depth", type=int, default=4, help="buffers prefetched ahead (4)")
    ap.add_argument("--no-prefetch", action="store_true", help="lock only, no prefetch")
    ap.add_argument("--repeat", type=int, default=3,
                    help="timed loops, each between two raw-copy measurements (3)")
    ap.add_argument("--beside", choices=("loop", "pass"), default="loop",
                    help="the raw copies' stretches: before and after each loop (the loop "
                         "runs as one), or beside each pass (each pass starts with an idle "
                         "link)")
    a = ap.parse_args()
    limit, size = parse_size(a.limit), parse_size(a.buffer)
    nbuf = max(2, int(a.factor * limit) // size)
    if a.repeat < 1 or a.passes < 1:
        ap.error("--repeat and --passes must be at least 1")
    if cp.cuda.runtime.getDeviceCount() < 1:
        print("SKIP: no CUDA device")
        return 77

    depth = 0 if a.no_prefetch else a.depth
    slots = max(1, limit // size)
    # the fewest bytes this loop's accesses must move under the limit
    loads, evictions = min_transfers(cyclic_trace(nbuf, a.passes), slots)
    min_in, min_out = loads * size, evictions * size
    # the fewest any schedule moves that honours every prefetch, from the
    # resident set the fill leaves (its last `slots` buffers): the best the
    # eviction policy can do for the first loop
    fill = list(range(max(0, nbuf - slots), nbuf))
    pf_loads, pf_evictions = min_transfers(
        prefetch_trace(nbuf, a.passes, depth, wrap=False), slots, resident=fill)
    pf_bytes = (pf_loads + pf_evictions) * size

    link = RawLink(min(size, 256 << 20))
    raws = [link.measure()]
    print("cupy_loop: raw pinned copies %.1f GB/s D2H, %.1f GB/s H2D, %.1f GB/s both at once"
          % raws[0])

    rt = dmem.Runtime(device_limit=limit, backend="cuda")
    view = None
    try:
        cs = cp.cuda.Stream(non_blocking=True)
        ps = rt.stream()  # prefetches: a stream nobody waits for
        bufs = [rt.alloc(size) for _ in range(nbuf)]
        print("cupy_loop: %d buffers of %d MiB = %.2f GiB under a %.2f GiB limit, %d passes, "
              "prefetch %s, %d timed loops"
              % (nbuf, size >> 20, nbuf * size / 2**30, limit / 2**30, a.passes,
                 "off" if a.no_prefetch else "depth %d" % a.depth, a.repeat))
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
        loops = []  # per timed loop: (ratio, ratio_moved, moved_over_min, moved_over_pf)
        # the raw stretches: as many bytes as a pass (beside each pass) or a
        # loop (before the first loop and after each) moves each way
        per_pass = a.beside == "pass"
        stretch = max(link.nbytes, pf_loads * size // (a.passes if per_pass else 1))
        if not per_pass:
            loop_bw = [link.stream(stretch)]
        for r in range(a.repeat):
            rt.poll()
            s0 = rt.stats()
            elapsed, bound_moved, raw_s, raw_bytes, steps = 0.0, 0.0, 0.0, 0, []
            pass_t, pass_bw = [], []
            d2h_bw, h2d_bw = raws[-1][0], raws[-1][1]  # one way at a time: the last measure
            for p in range(a.passes if per_pass else 1):
                # --beside pass: each pass beside a stretch of raw copies, raw
                # first and the pass first in turn (the same tenth of a second
                # on the link; each pass then starts with an idle link)
                raw_first = per_pass and (r * a.passes + p) % 2 == 0
                if raw_first:
                    bw = link.stream(stretch)
                q0 = rt.stats()
                t, st = timed_passes(rt, bufs, cs, ps, p, 1 if per_pass else a.passes, a.passes,
                                     depth)
                q1 = rt.stats()
                if per_pass and not raw_first:
                    bw = link.stream(stretch)
                if not per_pass:  # --beside loop: the stretches before and after it
                    loop_bw.append(link.stream(stretch))
                    bw = (loop_bw[-2] + loop_bw[-1]) / 2
                bound_moved += link_bound_seconds(
                    q1["bytes_spilled"] - q0["bytes_spilled"],
                    q1["bytes_unspilled"] - q0["bytes_unspilled"], d2h_bw, h2d_bw, bw)
                raw_bytes += 2 * stretch
                raw_s += 2 * stretch / (bw * 1e9)
                elapsed += t
                steps += st
                pass_t.append(t)
                pass_bw.append(bw)
            if not per_pass:
                pass_t = [sum(steps[k * nbuf:(k + 1) * nbuf]) for k in range(a.passes)]
            rt.poll()
            s1 = rt.stats()
            raws.append(link.measure())
            both_bw = raw_bytes / raw_s * 1e-9  # the passes' stretches of raw copies
            spilled = s1["bytes_spilled"] - s0["bytes_spilled"]
            unspilled = s1["bytes_unspilled"] - s0["bytes_unspilled"]
            bound = link_bound_seconds(min_out, min_in, d2h_bw, h2d_bw, both_bw)
            moved_over_min = ((spilled + unspilled) / (min_in + min_out)
                              if min_in + min_out else float("inf"))
            moved_over_pf = (spilled + unspilled) / pf_bytes if pf_bytes else float("inf")
            ratio = bound / elapsed if elapsed > 0 else 0.0
            ratio_moved = bound_moved / elapsed if elapsed > 0 else 0.0
            loops.append((ratio, ratio_moved, moved_over_min, moved_over_pf))
            per = sorted(steps)
            worst = max(range(len(steps)), key=steps.__getitem__)
            print("cupy_loop: loop %d: moved %.2f GiB out, %.2f GiB in (prefetched %.2f GiB; "
                  "ahead evictions %d, armed %d times, waits for room %d, %.3f s)"
                  % (r + 1, spilled / 2**30, unspilled / 2**30,
                     (s1["prefetch_bytes"] - s0["prefetch_bytes"]) / 2**30,
                     s1["ahead_evictions"] - s0["ahead_evictions"],
                     s1["ahead_arms"] - s0["ahead_arms"],
                     s1["room_waits"] - s0["room_waits"],
                     s1["seconds_waiting_for_room"] - s0["seconds_waiting_for_room"]))
            print("cupy_loop: loop %d: passes %s s (raw copies beside %s %s GB/s); a lock's "
                  "median %.2f ms, slowest %.2f ms (pass %d, buffer %d); pinned pool grew %d "
                  "times (%d by its thread) from %.2f GiB (%.2f free) to %.2f, pageable blocks %d"
                  % (r + 1, " ".join("%.3f" % t for t in pass_t),
                     "them" if per_pass else "it, before and after",
                     " ".join("%.1f" % x for x in (pass_bw if per_pass else loop_bw[-2:])),
                     per[len(per) // 2] * 1e3, steps[worst] * 1e3, worst // nbuf + 1,
                     worst % nbuf, s1["host_pool_grows"] - s0["host_pool_grows"],
                     s1["host_pool_background_grows"] - s0["host_pool_background_grows"],
                     s0["host_pool_reserved"] / 2**30, s0["host_pool_free"] / 2**30,
                     s1["host_pool_reserved"] / 2**30,
                     s1["host_pageable_allocs"] - s0["host_pageable_allocs"]))
            print("cupy_loop: loop %d: %.3f s; raw copies beside it %.1f GB/s both "
                  "ways, after it %.1f D2H, %.1f H2D, %.1f both; link-bound %.3f s (minimum "
                  "bytes): %.2f; for the bytes dmem moved (%.2fx the minimum) %.3f s: %.2f"
                  % ((r + 1, elapsed, both_bw) + raws[r + 1][:3] +
                     (bound, ratio, moved_over_min, bound_moved, ratio_moved)))
        bad = 0
        want_add = a.passes * a.repeat
        with cs:
            for i, b in enumerate(bufs):
                with b.lock(cs) as view:
                    x = cp.asarray(view).view(cp.float32)
                    want = float(i + want_add)
                    if float(x[0]) != want or float(x[-1]) != want:
                        bad += 1
                    del x
                del view
        huge = anon_huge_gib()
        if huge:
            print("cupy_loop: process memory %.2f GiB anonymous, %.2f GiB of it in huge pages"
                  % huge)
        print("cupy_loop: minimum %.2f GiB out, %.2f GiB in (Belady MIN: %d loads with room for "
              "%d of %d buffers)" % (min_out / 2**30, min_in / 2**30, loads, slots, nbuf))
        print("cupy_loop: fewest honouring the prefetches from the fill's resident set: %.2f GiB "
              "each way (%d loads); the first loop moved %.2fx that"
              % (pf_loads * size / 2**30, pf_loads, loops[0][3]))
        med = [sorted(col)[len(col) // 2] for col in zip(*loops)]
        print("cupy_loop: median of %d loops: %.2f of link-bound; for the bytes dmem moved %.2f "
              "(loops: %s)" % (len(loops), med[0], med[1],
                               " ".join("%.2f" % lp[1] for lp in loops)))
        print("RESULT cupy_loop.ratio=%.4f" % med[0])
        print("RESULT cupy_loop.ratio_moved=%.4f" % med[1])
        print("RESULT cupy_loop.ratio_moved_first=%.4f" % loops[0][1])
        print("RESULT cupy_loop.moved_over_min=%.4f" % med[2])
        print("RESULT cupy_loop.moved_over_pf=%.4f" % loops[0][3])
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
