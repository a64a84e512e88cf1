#!/usr/bin/env python3
"""The performance targets that scripts/gpu-test judges, and the judge.

    gpu_targets.py STEP LOG...            judge STEP's RESULT lines in LOG(s)
    gpu_targets.py --skip STEP REASON     every target of STEP, SKIPPED
    gpu_targets.py --list                 the table

The benchmarks print what they measure as machine-readable lines,
``RESULT name=value`` (one a line, anywhere in their output); this module
reads them and compares each with its target. Every target of a step gets
one verdict line on stdout, tab-separated:

    PASS|MISSED|SKIPPED <TAB> target name <TAB> figure (target ...) or reason

PASS: the figure meets the target. MISSED: it does not (the figure and the
target are printed). SKIPPED: there is no figure (the step did not run, a
library is missing, the log has no such RESULT line): the reason is
printed. A SKIPPED target is never counted as met. The exit status is 0
whatever the verdicts (2 on bad usage): speed is reported, not enforced;
gpu-test's exit status says only whether the steps were correct.

The targets come from the issues and docs/benchmarks.md (each entry names
its source). Ratios are dmem's figure over a baseline measured in the same
run, so they compare across machines; absolute figures do not.
"""
import re
import sys

RESULT_RE = re.compile(r"^RESULT ([A-Za-z0-9_.:+-]+)=([-+0-9.eE]+|nan|inf)\s*$")

MiB = 1 << 20


def parse_results(text):
    """{name: float} of every ``RESULT name=value`` line in text (the last
    one wins when a name repeats). Other lines are ignored."""
    out = {}
    for line in text.splitlines():
        m = RESULT_RE.match(line.strip())
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def _fmt(v):
    return "%.2f" % v


class Verdict:
    def __init__(self, status, name, detail):
        assert status in ("PASS", "MISSED", "SKIPPED")
        self.status, self.name, self.detail = status, name, detail

    def line(self):
        return "%s\t%s\t%s" % (self.status, self.name, self.detail)

    def __repr__(self):
        return "Verdict(%r, %r, %r)" % (self.status, self.name, self.detail)


def _compare(value, op, threshold):
    if value != value:  # NaN never meets a target
        return False
    return value >= threshold if op == ">=" else value <= threshold


def _single(name, key, op, threshold, what, results):
    if key not in results:
        return Verdict("SKIPPED", name, "no RESULT %s= in the log" % key)
    v = results[key]
    ok = _compare(v, op, threshold)
    return Verdict("PASS" if ok else "MISSED", name,
                   "%s %s (target %s %s)" % (what, _fmt(v), op, _fmt(threshold)))


# ---- the targets, per step -------------------------------------------------------------

# bench_spill: issue 9 (the spill engine) and docs/benchmarks.md: dmem / raw
# pinned cudaMemcpyAsync of the same bytes, >= 0.95 from 8 MiB, >= 0.80 at
# 1-4 MiB, >= 0.70 for the batch of 64 KiB buffers (one dmem_runtime_evict, one
# dmem_buffer_prefetch), >= 0.85 both directions at once; launches "well under
# 10 %" over bare launches (1000 launches, then one sync_and_unlock).
def spill_row_target(size, batch):
    """The bench_spill target for a row of buffers of `size` bytes (None:
    no target for that size)."""
    if batch:
        return 0.70
    if size >= 8 * MiB:
        return 0.95
    if size >= MiB:
        return 0.80
    return None


def _size_name(size):
    if size >= 1 << 30 and size % (1 << 30) == 0:
        return "%dGiB" % (size >> 30)
    if size >= MiB and size % MiB == 0:
        return "%dMiB" % (size >> 20)
    return "%dKiB" % (size >> 10)


def judge_bench_spill(results):
    rows = {}  # (batch, size, count) -> {"spill": v, "unspill": v}
    row_re = re.compile(r"^bench_spill\.(batch_)?(spill|unspill)\.([0-9]+)x([0-9]+)$")
    for key, v in results.items():
        m = row_re.match(key)
        if m:
            k = (bool(m.group(1)), int(m.group(3)), int(m.group(4)))
            rows.setdefault(k, {})[m.group(2)] = v
    out = []
    judged = 0
    for (batch, size, count) in sorted(rows, key=lambda k: (k[0], k[1], k[2])):
        want = spill_row_target(size, batch)
        if want is None:
            continue
        judged += 1
        r = rows[(batch, size, count)]
        name = "bench_spill %s%sx%d" % ("batch " if batch else "", _size_name(size), count)
        if "spill" not in r or "unspill" not in r:
            out.append(Verdict("SKIPPED", name, "only one direction in the log"))
            continue
        ok = _compare(r["spill"], ">=", want) and _compare(r["unspill"], ">=", want)
        out.append(Verdict("PASS" if ok else "MISSED", name,
                           "spill %s, unspill %s of raw (target >= %s)"
                           % (_fmt(r["spill"]), _fmt(r["unspill"]), _fmt(want))))
    if judged == 0:
        out.append(Verdict("SKIPPED", "bench_spill rows",
                           "no bandwidth RESULT rows of 1 MiB or more in the log"))
    out.append(_single("bench_spill both ways", "bench_spill.both", ">=", 0.85,
                       "spill + unspill at once", results))
    out.append(_single("bench_spill launches", "bench_spill.launch_batched", "<=", 1.10,
                       "1000 launches + sync_and_unlock, dmem / bare", results))
    # issue 25 item 4: a stream_release after every launch, <= 1.10x bare
    out.append(_single("bench_spill launch + release", "bench_spill.launch_release", "<=", 1.10,
                       "1000 x (launch + stream_release), then sync, dmem / bare", results))
    return out


# bench_lock: docs/benchmarks.md ("Lock, unlock and the entry points"), a
# lock+unlock pair of a resident buffer <= 50 ns (an absolute figure: the
# machine's atomics set it; 33 ns on the lent H100, 14 ns on the CI machine).
def judge_bench_lock(results):
    return [_single("bench_lock lock+unlock", "bench_lock.lock_unlock_ns", "<=", 50.0,
                    "ns per pair, resident buffer", results)]


# bench_scale: issue 25 item 1, each cost at 10^6 live buffers within 1.5x
# of its cost at 10^3 (judged at the largest count the log measured, named in
# the verdict: the quick mode stops at 10^5), and at most 128 bytes of
# metadata per live buffer.
SCALE_ROWS = [
    ("alloc_free", "alloc+free pair"),
    ("lock_unlock", "lock+unlock"),
    ("evict_one", "eviction of one victim"),
    ("stats", "dmem_stats"),
    ("release_1e3", "stream_release of 10^3 locks"),
    ("release_1e4", "stream_release of 10^4 locks"),
]


def judge_bench_scale(results):
    largest = results.get("bench_scale.largest")
    at = "at %.0e live buffers" % largest if largest else "at the largest count"
    out = []
    for key, what in SCALE_ROWS:
        out.append(_single("bench_scale %s" % what, "bench_scale.%s.growth" % key, "<=", 1.50,
                           "cost %s / cost at 1e+03" % at, results))
    out.append(_single("bench_scale metadata", "bench_scale.meta_bytes", "<=", 128.0,
                       "bytes per live buffer %s" % at, results))
    return out


# bench_disk: docs/benchmarks.md ("The disk tier"), dmem / raw pwrite and
# pread >= 0.90 at every size (issue 25), judged on the worst of them.
def judge_bench_disk(results):
    return [_single("bench_disk worst", "bench_disk.worst", ">=", 0.90,
                    "worst dmem/raw", results)]


# cublas: docs/benchmarks.md (the pinned pool), 2x oversubscribed cuBLAS
# through dmem >= 0.90 of cuBLAS on plain cudaMalloc memory in the same
# process, with the pinned pool growing and with a pinned reserve.
def judge_cublas(results):
    return [
        _single("cublas 2x pool growing", "cublas.ratio_pool_growing", ">=", 0.90,
                "of plain cudaMalloc cuBLAS", results),
        _single("cublas 2x reserve", "cublas.ratio_reserve", ">=", 0.90,
                "of plain cudaMalloc cuBLAS", results),
    ]


# cupy_loop, two targets. The link: >= 0.95 of link-bound for the bytes dmem
# moved (issue 25 item 5; issue 9 asked 0.85): the loop's time against those
# bytes at the raw pinned bandwidth measured just before and after it, how
# well the moves kept the link busy; the median of the script's timed loops
# (three by default; the first one's is reported beside it). The bytes: at
# most 1.2x the fewest any schedule honouring the loop's prefetches moves (issue 25 item 2; examples/linkbound.py). The
# share of the bound of the fewest bytes with no prefetches at all (Belady's
# MIN), which no schedule honouring a prefetch depth of 4 can bring above
# about 0.75 (docs/design.md, "Prefetch hints"), is reported with the first.
def judge_cupy_loop(results):
    v = _single("cupy_loop link", "cupy_loop.ratio_moved", ">=", 0.95,
                "of link-bound for the bytes dmem moved", results)
    if "cupy_loop.ratio_moved_first" in results:
        v.detail += " (the first loop %.2f)" % results["cupy_loop.ratio_moved_first"]
    if "cupy_loop.ratio" in results:
        v.detail += "; %.2f of the bound of the fewest bytes without prefetches" % (
            results["cupy_loop.ratio"])
    if "cupy_loop.moved_over_min" in results:
        v.detail += " (moved %.2fx those)" % results["cupy_loop.moved_over_min"]
    b = _single("cupy_loop bytes", "cupy_loop.moved_over_pf", "<=", 1.20,
                "bytes moved over the fewest honouring the prefetches", results)
    return [v, b]


STEPS = {
    "bench_spill": judge_bench_spill,
    "bench_lock": judge_bench_lock,
    "bench_scale": judge_bench_scale,
    "bench_disk": judge_bench_disk,
    "cublas": judge_cublas,
    "cupy_loop": judge_cupy_loop,
}


def judge(step, results):
    """The verdicts of STEP's targets on `results` (parse_results' dict)."""
    return STEPS[step](results)


def skip(step, reason):
    """Every target of STEP as SKIPPED with `reason`."""
    return [Verdict("SKIPPED", v.name, reason) for v in judge(step, {})]


def count(verdicts):
    """(met, missed, skipped)."""
    met = sum(v.status == "PASS" for v in verdicts)
    missed = sum(v.status == "MISSED" for v in verdicts)
    return met, missed, len(verdicts) - met - missed


def main(argv):
    if len(argv) >= 2 and argv[1] == "--list":
        for step in STEPS:
            for v in judge(step, {}):
                print("%s\t%s" % (step, v.name))
        return 0
    if len(argv) == 4 and argv[1] == "--skip" and argv[2] in STEPS:
        for v in skip(argv[2], argv[3]):
            print(v.line())
        return 0
    if len(argv) < 3 or argv[1] not in STEPS:
        sys.stderr.write("usage: gpu_targets.py STEP LOG... | --skip STEP REASON | --list\n"
                         "steps: %s\n" % ", ".join(STEPS))
        return 2
    text = ""
    for path in argv[2:]:
        try:
            with open(path, errors="replace") as f:
                text += f.read() + "\n"
        except OSError as e:
            sys.stderr.write("gpu_targets.py: %s\n" % e)
    for v in judge(argv[1], parse_results(text)):
        print(v.line())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
