"""Plot the spill/unspill bandwidth tables printed by bench_spill (GPU).

Usage: python3 bench/plot_spill.py bench.log spill_bandwidth.png

Left: GB/s of dmem spill / unspill and raw pinned cudaMemcpyAsync D2H / H2D
per row (single buffers from 64 KiB to 1 GiB, the batch of 64 KiB buffers).
Right: dmem / raw ratios with the targets (0.95 from 8 MiB, 0.80 at 1 MiB,
0.70 for the batch, 0.85 both directions at once). Without matplotlib (the
GPU image may lack it) it prints the ratios and exits 0 without a PNG.
"""
import re
import sys

ROW = re.compile(r"^((?:batch )?\d+ [KMG]iB x \d+)\s*\|(.*)$")
BOTH = re.compile(r"^dmem_spill \+ dmem_prefetch\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|")


def parse(path):
    rows, both = [], None
    for line in open(path):
        m = ROW.match(line)
        if m:
            v = [float(c) for c in m.group(2).split("|")[:6]]
            rows.append({"what": m.group(1), "spill": v[0], "d2h": v[1], "unspill": v[3],
                         "h2d": v[4]})
            continue
        m = BOTH.match(line)
        if m:
            both = (float(m.group(1)), float(m.group(2)))
    return rows, both


def target(what):
    if what.startswith("batch"):
        return 0.70
    n, unit = what.split()[:2]
    size = int(n) * {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]
    return 0.95 if size >= 8 << 20 else 0.80 if size >= 1 << 20 else None


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    rows, both = parse(sys.argv[1])
    if not rows:
        sys.exit("plot_spill: no bandwidth rows in " + sys.argv[1])
    for r in rows:
        print("%-22s spill %.2f  unspill %.2f" % (r["what"], r["spill"] / r["d2h"],
                                                  r["unspill"] / r["h2d"]))
    if both:
        print("%-22s %.2f" % ("both at once", both[0] / both[1]))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_spill: matplotlib not available: no PNG written (ratios above)")
        return
    labels = [r["what"].replace(" x ", "\nx ") for r in rows]
    x = list(range(len(rows)))
    w = 0.2
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    ax.bar([i - 1.5 * w for i in x], [r["d2h"] for r in rows], w, label="raw pinned D2H",
           color="#bbbbbb")
    ax.bar([i - 0.5 * w for i in x], [r["spill"] for r in rows], w, label="dmem spill",
           color="#d62728")
    ax.bar([i + 0.5 * w for i in x], [r["h2d"] for r in rows], w, label="raw pinned H2D",
           color="#888888")
    ax.bar([i + 1.5 * w for i in x], [r["unspill"] for r in rows], w, label="dmem unspill",
           color="#1f77b4")
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("GB/s")
    ax.set_title("dmem spill / unspill vs raw cudaMemcpyAsync")
    ax.legend(fontsize=8)
    ax2.plot(x, [r["spill"] / r["d2h"] for r in rows], "o-", color="#d62728", label="spill")
    ax2.plot(x, [r["unspill"] / r["h2d"] for r in rows], "s-", color="#1f77b4", label="unspill")
    for i, r in enumerate(rows):
        t = target(r["what"])
        if t:
            ax2.hlines(t, i - 0.4, i + 0.4, colors="k", linestyles="dashed")
    if both:
        ax2.plot([len(rows)], [both[0] / both[1]], "D", color="#2ca02c", label="both at once")
        ax2.hlines(0.85, len(rows) - 0.4, len(rows) + 0.4, colors="k", linestyles="dashed")
    ax2.set_xticks(x + ([len(rows)] if both else []))
    ax2.set_xticklabels(labels + (["both\nat once"] if both else []), fontsize=7)
    ax2.set_ylim(0, 1.3)
    ax2.set_ylabel("dmem / raw (dashed: target)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)
    print("plot_spill: wrote " + sys.argv[2])


if __name__ == "__main__":
    main()
