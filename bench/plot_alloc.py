"""Plot bench_alloc's single-thread pair table and its thread scaling (GPU run).

Usage: python3 bench/plot_alloc.py bench_alloc.log docs/img/alloc_pairs.png
Reads the "1 thread (its own stream)" table (ns per alloc+free pair for every
allocator) and the "16 threads, each on its own stream" table (dmem's
aggregate ns per pair), and draws them side by side, log scale.
"""
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLS = ["dmem", "dmem buf", "cudaMalloc", "MallocAsync", "RMM pool", "RMM arena"]


def table(lines, title_re):
    """Rows {size: [cells]} of the first table whose title matches."""
    rows, on = {}, False
    for line in lines:
        if re.search(title_re, line):
            on = True
            continue
        if on:
            if not line.strip() or line.startswith(("threads:", "4 KiB, 1000 live:")):
                if rows:
                    break
                continue
            cells = [c.strip() for c in line.split("|")]
            if len(cells) > 2 and re.match(r"^\d+ [KMG]?i?B$", cells[0]):
                rows[cells[0]] = cells[1:]
    return rows


def num(cell):
    m = re.match(r"^(\d+(?:\.\d+)?)", cell)
    return float(m.group(1)) if m else None


def main():
    lines = open(sys.argv[1]).read().splitlines()
    one = table(lines, r"alloc\+free pair, 1 thread \(its own stream\)")
    sixteen = table(lines, r"alloc\+free pair, 16 threads, each on its own stream")
    sizes = list(one)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / len(COLS)
    for k, col in enumerate(COLS):
        ys = [num(one[s][k]) if k < len(one[s]) else None for s in sizes]
        xs = [i + (k - len(COLS) / 2) * width + width / 2 for i in range(len(sizes))]
        ax.bar([x for x, y in zip(xs, ys) if y], [y for y in ys if y], width, label=col)
    ax.set_yscale("log")
    ax.set_xticks(range(len(sizes)), sizes)
    ax.set_ylabel("ns per alloc+free pair (1 thread)")
    ax.set_title("allocation latency, lower is better")
    ax.legend(fontsize=8)
    if sixteen:
        s16 = [s for s in sizes if s in sixteen]
        ys1 = [num(one[s][0]) for s in s16]
        ys16 = [num(sixteen[s][0]) for s in s16]
        bx.bar([i - 0.2 for i in range(len(s16))], ys1, 0.4, label="dmem, 1 thread")
        bx.bar([i + 0.2 for i in range(len(s16))], ys16, 0.4, label="dmem, 16 threads (aggregate)")
        bx.set_yscale("log")
        bx.set_xticks(range(len(s16)), s16)
        bx.set_ylabel("ns per pair (wall time / all pairs)")
        bx.set_title("thread scaling, each thread on its own stream")
        bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
