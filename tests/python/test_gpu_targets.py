"""scripts/gpu_targets.py: the RESULT lines that scripts/gpu-test reads,
and its verdicts, on canned benchmark output (the GPU run is the lead's)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_targets  # noqa: E402

# Canned output in the benchmarks' formats: prose and RESULT lines mixed.
BENCH_LOG = """\
bench_spill: NVIDIA H100 80GB HBM3 (device 0), full, 7 repetitions (median), optimised
1 MiB x 256            |     49.5 |     49.5 |  1.00 |     47.7 |     48.0 |  0.99
targets (dmem / raw, this run):
RESULT bench_spill.spill.65536x256=0.8500
RESULT bench_spill.unspill.65536x256=0.9700
RESULT bench_spill.spill.1048576x256=1.0000
RESULT bench_spill.unspill.1048576x256=0.9900
RESULT bench_spill.spill.8388608x64=0.9300
RESULT bench_spill.unspill.8388608x64=1.0000
RESULT bench_spill.batch_spill.65536x1024=0.4200
RESULT bench_spill.batch_unspill.65536x1024=0.9700
RESULT bench_spill.both=1.0200
RESULT bench_spill.launch_batched=1.0900
RESULT bench_spill.launch_release=1.8600
bench_disk: worst dmem/raw 0.64 (target >= 0.90)
RESULT bench_disk.read.1048576=0.6400
RESULT bench_disk.worst=0.6400
not a RESULT bench_disk.worst=0.99 line
RESULT broken=
"""


def by_name(verdicts):
    return {v.name: v for v in verdicts}


def test_parse_results_reads_only_result_lines():
    r = gpu_targets.parse_results(BENCH_LOG)
    assert r["bench_disk.worst"] == pytest.approx(0.64)
    assert r["bench_spill.both"] == pytest.approx(1.02)
    assert "broken" not in r
    assert len(r) == 13


def test_bench_spill_rows_judged_against_their_size_targets():
    v = by_name(gpu_targets.judge("bench_spill", gpu_targets.parse_results(BENCH_LOG)))
    assert v["bench_spill 1MiBx256"].status == "PASS"
    # 0.93 < 0.95 from 8 MiB
    assert v["bench_spill 8MiBx64"].status == "MISSED"
    assert "0.93" in v["bench_spill 8MiBx64"].detail and ">= 0.95" in v["bench_spill 8MiBx64"].detail
    assert v["bench_spill batch 64KiBx1024"].status == "MISSED"
    assert "0.42" in v["bench_spill batch 64KiBx1024"].detail
    assert v["bench_spill both ways"].status == "PASS"
    assert v["bench_spill launches"].status == "PASS"
    assert v["bench_spill launch + release"].status == "MISSED"
    # 64 KiB single buffers have no target
    assert not any("64KiBx256" in n for n in v)


def test_bench_disk_worst_missed_with_figure_and_target():
    (v,) = gpu_targets.judge("bench_disk", gpu_targets.parse_results(BENCH_LOG))
    assert v.status == "MISSED"
    assert "0.64" in v.detail and ">= 0.90" in v.detail
    # issue 25: 0.90 of raw file I/O on every row
    (v,) = gpu_targets.judge("bench_disk", {"bench_disk.worst": 0.85})
    assert v.status == "MISSED"
    (v,) = gpu_targets.judge("bench_disk", {"bench_disk.worst": 0.90})
    assert v.status == "PASS"


def test_missing_figure_is_skipped_never_passed():
    for step in gpu_targets.STEPS:
        verdicts = gpu_targets.judge(step, {})
        assert verdicts and all(v.status == "SKIPPED" for v in verdicts), step
        assert gpu_targets.count(verdicts) == (0, 0, len(verdicts))


def test_launch_target_is_an_upper_bound():
    v = by_name(gpu_targets.judge("bench_spill", {"bench_spill.launch_batched": 1.2}))
    assert v["bench_spill launches"].status == "MISSED"


def test_nan_never_meets_a_target():
    (v,) = gpu_targets.judge("bench_disk", {"bench_disk.worst": float("nan")})
    assert v.status == "MISSED"


def test_cupy_loop_link_and_bytes():
    v = by_name(gpu_targets.judge("cupy_loop", {"cupy_loop.ratio": 0.5,
                                                "cupy_loop.ratio_moved": 0.96,
                                                "cupy_loop.moved_over_min": 2.04,
                                                "cupy_loop.moved_over_pf": 1.25}))
    assert v["cupy_loop link"].status == "PASS"
    assert "0.50 of the bound of the fewest bytes" in v["cupy_loop link"].detail
    assert "2.04x" in v["cupy_loop link"].detail
    assert v["cupy_loop bytes"].status == "MISSED"
    v = by_name(gpu_targets.judge("cupy_loop", {"cupy_loop.ratio_moved": 0.94,
                                                "cupy_loop.moved_over_pf": 1.15}))
    assert v["cupy_loop link"].status == "MISSED"
    assert v["cupy_loop bytes"].status == "PASS"
    # the median is judged; the first loop (the pinned pool's growth) is shown
    v = by_name(gpu_targets.judge("cupy_loop", {"cupy_loop.ratio_moved": 0.97,
                                                "cupy_loop.ratio_moved_first": 0.88,
                                                "cupy_loop.moved_over_pf": 1.05}))
    assert v["cupy_loop link"].status == "PASS"
    assert "the first loop 0.88" in v["cupy_loop link"].detail


def test_cublas_both_ratios():
    v = by_name(gpu_targets.judge("cublas", {"cublas.ratio_pool_growing": 1.0,
                                             "cublas.ratio_reserve": 0.5}))
    assert v["cublas 2x pool growing"].status == "PASS"
    assert v["cublas 2x reserve"].status == "MISSED"


def run_cli(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_targets.py")]
                          + list(args), capture_output=True, text=True)


def test_bench_lock_is_an_upper_bound_in_ns():
    (v,) = gpu_targets.judge("bench_lock", {"bench_lock.lock_unlock_ns": 32.8})
    assert v.status == "PASS" and "32.80" in v.detail
    (v,) = gpu_targets.judge("bench_lock", {"bench_lock.lock_unlock_ns": 51})
    assert v.status == "MISSED"


def test_cli_prints_tab_separated_verdicts(tmp_path):
    log = tmp_path / "bench.log"
    log.write_text(BENCH_LOG)
    p = run_cli("bench_disk", str(log))
    assert p.returncode == 0
    assert p.stdout.splitlines() == [
        "MISSED\tbench_disk worst\tworst dmem/raw 0.64 (target >= 0.90)"]


def test_cli_skip_gives_the_reason():
    p = run_cli("--skip", "cupy_loop", "CuPy not importable")
    assert p.stdout.splitlines() == ["SKIPPED\tcupy_loop link\tCuPy not importable",
                                     "SKIPPED\tcupy_loop bytes\tCuPy not importable"]


def test_cli_bad_step_is_a_usage_error():
    assert run_cli("no_such_step", "x").returncode == 2


def test_gpu_test_summary_lines_and_counts(tmp_path):
    # scripts/gpu-test's own targets() function, on the canned log: one
    # summary line per target, and the met / missed / skipped counts
    log = tmp_path / "bench.log"
    log.write_text(BENCH_LOG)
    script = """
ROOT=%s
eval "$(sed -n '/^targets() {/,/^}/p' "$ROOT/scripts/gpu-test")"
TARGETS=(); T_MET=0 T_MISSED=0 T_SKIPPED=0
targets bench_spill %s >/dev/null
targets bench_disk %s >/dev/null
targets --skip cupy_loop "not run: CuPy not importable" >/dev/null
printf '%%s\\n' "${TARGETS[@]}"
echo "counts $T_MET $T_MISSED $T_SKIPPED"
""" % (os.path.abspath(ROOT), log, log)
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[-1] == "counts 3 4 2"
    assert any(l.startswith("bench_disk worst:") and "MISSED" in l and "0.64" in l
               for l in lines)
    assert any(l.startswith("cupy_loop link:") and "SKIPPED" in l and "CuPy" in l for l in lines)


def test_bench_scale_growth_and_metadata():
    log = """\
dmem_stats, us                             |      0.22  1.00x |      0.23  1.01x
RESULT bench_scale.alloc_free.growth=1.030
RESULT bench_scale.lock_unlock.growth=1.040
RESULT bench_scale.evict_one.growth=218.420
RESULT bench_scale.stats.growth=1.110
RESULT bench_scale.release_1e3.growth=1.510
RESULT bench_scale.release_1e4.growth=0.900
RESULT bench_scale.largest=1000000
RESULT bench_scale.meta_bytes=189.7
"""
    v = by_name(gpu_targets.judge("bench_scale", gpu_targets.parse_results(log)))
    assert v["bench_scale dmem_stats"].status == "PASS"
    assert "1e+06" in v["bench_scale dmem_stats"].detail
    assert v["bench_scale eviction of one victim"].status == "MISSED"
    assert v["bench_scale stream_release of 10^3 locks"].status == "MISSED"
    assert v["bench_scale metadata"].status == "MISSED"
    assert "189.70" in v["bench_scale metadata"].detail and "<= 128.00" in v["bench_scale metadata"].detail


def test_launch_release_target():
    v = by_name(gpu_targets.judge("bench_spill", {"bench_spill.launch_release": 1.86}))
    assert v["bench_spill launch + release"].status == "MISSED"
    v = by_name(gpu_targets.judge("bench_spill", {"bench_spill.launch_release": 1.05}))
    assert v["bench_spill launch + release"].status == "PASS"
