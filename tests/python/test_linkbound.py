"""examples/linkbound.py: the minimum bytes behind cupy_loop's link-bound
(Belady's MIN), checked against an exhaustive search on small traces."""

import functools
import itertools
import os
import random
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import linkbound  # noqa: E402


def exhaustive_min_loads(trace, slots):
    """The fewest loads over every eviction choice, from every resident
    start of `slots` buffers (small traces only)."""
    ids = sorted(set(trace))

    @functools.lru_cache(maxsize=None)
    def best(i, cache):
        if i == len(trace):
            return 0
        b = trace[i]
        if b in cache:
            return best(i + 1, cache)
        if len(cache) < slots:
            return 1 + best(i + 1, tuple(sorted(cache + (b,))))
        return 1 + min(best(i + 1, tuple(sorted(tuple(c for c in cache if c != v) + (b,))))
                       for v in cache)

    starts = itertools.combinations(ids, min(slots, len(ids)))
    return min(best(0, tuple(s)) for s in starts)


def test_cyclic_trace():
    assert linkbound.cyclic_trace(3, 2) == [0, 1, 2, 0, 1, 2]


@pytest.mark.parametrize("nbuf,slots,passes", [(3, 2, 2), (4, 2, 3), (5, 3, 2), (6, 4, 3),
                                               (4, 4, 3), (2, 1, 3)])
def test_min_matches_exhaustive_search_on_cyclic_loops(nbuf, slots, passes):
    trace = linkbound.cyclic_trace(nbuf, passes)
    loads, evictions = linkbound.min_transfers(trace, slots)
    assert loads == exhaustive_min_loads(trace, slots)
    assert evictions == loads  # the cache starts full: every load evicts


def test_min_matches_exhaustive_search_on_random_traces():
    rng = random.Random(7)
    for _ in range(40):
        nids = rng.randint(2, 5)
        trace = [rng.randrange(nids) for _ in range(rng.randint(1, 10))]
        slots = rng.randint(1, 3)
        loads, _ = linkbound.min_transfers(trace, slots)
        assert loads == exhaustive_min_loads(trace, slots), (trace, slots)


def test_min_is_below_lru_on_the_cupy_loop():
    # cupy_loop's defaults: 32 buffers of 256 MiB, room for 16, 3 passes.
    # LRU misses every access after the first pass's resident half (80);
    # MIN keeps 15 buffers across passes and loads 48.
    loads, evictions = linkbound.min_transfers(linkbound.cyclic_trace(32, 3), 16)
    assert (loads, evictions) == (48, 48)


def test_prefetch_trace():
    assert linkbound.prefetch_trace(3, 1, 1) == [1, 0, 2, 1, 0, 2]
    # no wrap: the last use is not preceded by a prefetch of the next pass
    assert linkbound.prefetch_trace(3, 1, 1, wrap=False) == [1, 0, 2, 1, 2]
    assert linkbound.prefetch_trace(3, 2, 1, wrap=False) == [1, 0, 2, 1, 0, 2, 1, 0, 2, 1, 2]
    assert linkbound.prefetch_trace(4, 1, 0) == linkbound.cyclic_trace(4, 1)


def test_prefetches_honoured_cost_about_depth_places():
    # cupy_loop's defaults from the resident set its fill leaves (the last
    # 16): MIN over the uses loads 51; honouring depth d prefetches, 55, 59,
    # 64 for d = 1, 2, 4 (tests/test_spill.c's prefetch loop counts the same)
    fill = list(range(16, 32))
    assert linkbound.min_transfers(linkbound.cyclic_trace(32, 3), 16, resident=fill) == (51, 51)
    got = [linkbound.min_transfers(linkbound.prefetch_trace(32, 3, d), 16, resident=fill)[0]
           for d in (1, 2, 4)]
    assert got == [55, 59, 64]
    # cupy_loop's timed loop prefetches nothing past its last lock
    got = [linkbound.min_transfers(linkbound.prefetch_trace(32, 3, d, wrap=False), 16,
                                   resident=fill)[0] for d in (1, 2, 4)]
    assert got == [54, 57, 63]


@pytest.mark.parametrize("nbuf,slots,passes,depth", [(4, 3, 2, 1), (5, 3, 2, 1), (6, 4, 2, 2)])
def test_prefetch_min_matches_exhaustive_search(nbuf, slots, passes, depth):
    for wrap in (True, False):
        trace = linkbound.prefetch_trace(nbuf, passes, depth, wrap=wrap)
        assert linkbound.min_transfers(trace, slots)[0] == exhaustive_min_loads(trace, slots)


def test_everything_fits_moves_nothing():
    assert linkbound.min_transfers(linkbound.cyclic_trace(8, 5), 8) == (0, 0)


def test_given_resident_start():
    # nothing resident: every first touch is a load, evictions only once full
    assert linkbound.min_transfers([0, 1, 2, 0], 2, resident=[]) == (3, 1)


def test_bad_slots():
    with pytest.raises(ValueError):
        linkbound.min_transfers([0, 1], 0)
    with pytest.raises(ValueError):
        linkbound.min_transfers([0, 1], 1, resident=[0, 1])


def test_link_bound_seconds_takes_the_slowest_constraint():
    # 10 GB each way at 50 GB/s alone, 80 GB/s together: 20 GB / 80 = 0.25 s
    assert linkbound.link_bound_seconds(10e9, 10e9, 50, 50, 80) == pytest.approx(0.25)
    # one direction only: its own bandwidth bounds it
    assert linkbound.link_bound_seconds(10e9, 0, 50, 50, 80) == pytest.approx(0.2)
