"""The fewest bytes a loop over spillable buffers must move, and the time
the PCIe link needs for them: the "link-bound" of examples/cupy_loop.py.

A loop that touches more bytes than the device limit holds must bring
buffers in (host->device) and send others out (device->host). How many is
not dmem's choice to report: it follows from the access trace and the
limit alone. Belady's MIN (evict the resident buffer whose next use is
farthest in the future; Belady 1966, optimal for equal sizes) gives the
fewest loads any schedule can do; every buffer the loop touches is written
(``x += 1``), so each eviction that makes room for a load writes one
buffer back: the minimum is that many bytes each way.

    min_transfers(trace, slots)            -> loads, evictions (MIN)
    cyclic_trace(nbuf, passes)             -> the cupy_loop trace
    prefetch_trace(nbuf, passes, depth, wrap) -> the same, each prefetch an access
    link_bound_seconds(out, in, d2h, h2d, both) -> seconds at the link

Pure Python, no CuPy: tests/python/test_linkbound.py checks it on the host.
"""


def min_transfers(trace, slots, resident=None):
    """Belady's MIN over `trace` (a sequence of buffer ids) with room for
    `slots` equal-size buffers. `resident`: the buffers resident at the
    start (default: the first `slots` distinct ids of the trace, the best
    start there is, so the count is a lower bound whatever the loop found
    resident). Returns (loads, evictions): the fewest buffers any schedule
    must bring in, and how many of those loads had to evict a resident
    buffer first (each a write-back when the buffers are written)."""
    if slots < 1:
        raise ValueError("slots must be at least 1")
    trace = list(trace)
    if resident is None:
        resident = []
        for b in trace:
            if b not in resident:
                resident.append(b)
            if len(resident) == slots:
                break
    cache = set(resident)
    if len(cache) > slots:
        raise ValueError("more resident buffers than slots")
    # next_use[i]: the index of the next access to trace[i] after i
    n = len(trace)
    next_use = [n] * n
    last = {}
    for i in range(n - 1, -1, -1):
        next_use[i] = last.get(trace[i], n + 1 + i)  # never again: farther than any use
        last[trace[i]] = i
    # the next use of each resident buffer, from the current position
    upcoming = {b: last.get(b, 2 * n + 1) for b in cache}
    loads = evictions = 0
    for i, b in enumerate(trace):
        if b not in cache:
            loads += 1
            if len(cache) >= slots:
                victim = max(cache, key=lambda c: upcoming[c])
                cache.remove(victim)
                del upcoming[victim]
                evictions += 1
            cache.add(b)
        upcoming[b] = next_use[i]
    return loads, evictions


def cyclic_trace(nbuf, passes):
    """The buffers cupy_loop locks in its timed loop: `passes` passes over
    buffers 0..nbuf-1 in order."""
    return [i for _ in range(passes) for i in range(nbuf)]


def prefetch_trace(nbuf, passes, depth, wrap=True):
    """cupy_loop's trace with its prefetches honoured: before the use of
    buffer i, an access to each of the next `depth` (a prefetch brings the
    buffer in and keeps it until its use). MIN over it is the fewest loads
    of any schedule that honours every prefetch: with `slots` places it
    keeps about slots - depth - 1 buffers for the whole loop, where MIN
    over the uses alone keeps slots - 1. `wrap`: the last pass prefetches
    the next pass's first buffers too (a loop that goes on); False: no
    prefetch past the loop's last use (cupy_loop's timed loop)."""
    n = passes * nbuf
    return [b for p in range(passes) for i in range(nbuf)
            for b in [(i + k) % nbuf for k in range(1, depth + 1)
                      if wrap or p * nbuf + i + k < n] + [i]]


def link_bound_seconds(out_bytes, in_bytes, d2h_gbps, h2d_gbps, both_gbps):
    """The time the link needs for `out_bytes` device->host and `in_bytes`
    host->device at the given pinned bandwidths (GB/s: each direction
    alone, and both at once): the slowest of the three constraints."""
    return max(out_bytes / (d2h_gbps * 1e9), in_bytes / (h2d_gbps * 1e9),
               (out_bytes + in_bytes) / (both_gbps * 1e9))
