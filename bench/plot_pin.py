"""Plot bench_pin's table: GB/s of each way of getting pinned host memory,
per chunk size, beside the D2H copy rate it has to keep up with.

    python3 bench/plot_pin.py pin.txt docs/img/pin_rates.png
"""
import sys


def read(path):
    rows, head = [], None
    for line in open(path):
        cells = [c.strip() for c in line.split("|")]
        if len(cells) < 3:
            continue
        if cells[0] == "chunk":
            head = cells[1:]
        elif head and cells[0].endswith("MiB"):
            rows.append((cells[0], [float(c) for c in cells[1:]]))
    if not head or not rows:
        raise SystemExit(f"{path}: no bench_pin table")
    return head, rows


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    head, rows = read(sys.argv[1])
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / len(rows)
    for k, (size, vals) in enumerate(rows):
        xs = [i + (k - (len(rows) - 1) / 2) * width for i in range(len(head))]
        ax.bar(xs, vals, width, label=size)
    ax.set_xticks(range(len(head)))
    ax.set_xticklabels(head, rotation=15)
    ax.set_ylabel("GB/s")
    ax.set_title("Getting pinned host memory (bench_pin), against the D2H copy it feeds")
    ax.legend(title="chunk")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
