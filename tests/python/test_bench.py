"""The alloc+free micro-benchmark runs and stays thin. The bounds are
relative to a baseline measured in the same run (bytearray(64) and its
free: about 100-250 ns on the 2-core CI-class machine), so that a loaded
machine slows both; bench_python.py prints the real figure (target on the
development machine: <= 1.5 us per pair, 15x that baseline)."""

import bench_python


def test_alloc_free_pair_is_thin(capsys):
    r = bench_python.bench("host", n=50_000)
    pair = r["alloc+free"]
    with capsys.disabled():
        print(f"\nalloc+free pair: {pair * 1e6:.3f} us "
              f"(baseline bytearray: {r['baseline bytearray+free'] * 1e6:.3f} us)")
    base = r["baseline bytearray+free"]
    # measured 6.8-7.1x under load here; a pair through a Python-level
    # allocator, or a lock that waits, is far above 15x
    assert pair < 15 * base, f"alloc+free pair {pair * 1e9:.0f} ns, baseline {base * 1e9:.0f} ns"
    lock = r["lock+unlock (view)"]
    assert lock < 15 * base, f"lock+unlock {lock * 1e9:.0f} ns, baseline {base * 1e9:.0f} ns"


def test_alloc_pairs_against_cupy_run():
    """bench_pairs measures every size on the host backend; the CuPy column
    is a figure when CuPy works here and None (with the reason) otherwise."""
    r = bench_python.bench_pairs("host", budget=0.002)
    why = r.pop("_cupy")
    assert r.pop("_backend") == "host"
    assert sorted(r) == sorted(bench_python.PAIR_SIZES)
    # the same pair at 64 B, measured now: every size is a pool or raw-table
    # hit on the host backend and costs about the same (0.5-1.1 us here)
    small = bench_python.bench("host", n=20_000)["alloc+free"]
    for size, (d, c) in r.items():
        assert 0 < d < 10 * small, (size, d, small)
        assert (c is None) == (why is not None), (size, c, why)
