"""Plot the spill/unspill bandwidth table printed by bench_spill (GPU).

Usage: python3 bench/plot_spill.py bench.log docs/img/spill_bandwidth.png
"""
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def parse(path):
    rows = []
    for line in open(path):
        if not re.match(r"^\d+ [KMG]iB x \d+\s*\|", line):
            continue
        cells = [c.strip() for c in line.split("|")]
        v = [float(c) for c in cells[1:9]]
        rows.append((cells[0], v[0], v[1], v[3], v[4]))
    return rows


def main():
    rows = parse(sys.argv[1])
    labels = [r[0] for r in rows]
    x = range(len(rows))
    w = 0.2
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.bar([i - 1.5 * w for i in x], [r[2] for r in rows], w, label="raw pinned D2H", color="#bbbbbb")
    ax.bar([i - 0.5 * w for i in x], [r[1] for r in rows], w, label="dmem spill", color="#d62728")
    ax.bar([i + 0.5 * w for i in x], [r[4] for r in rows], w, label="raw pinned H2D", color="#888888")
    ax.bar([i + 1.5 * w for i in x], [r[3] for r in rows], w, label="dmem unspill", color="#1f77b4")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels)
    ax.set_ylabel("GB/s")
    ax.set_title("dmem spill / unspill vs raw cudaMemcpyAsync, H100 80GB HBM3 (PCIe Gen5)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
