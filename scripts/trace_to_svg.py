#!/usr/bin/env python3
"""Draw a DMEM_TRACE file as an SVG timeline: one row per track (tier or
stream), one box per event, coloured by event name. For a picture in the
docs or a report where Perfetto (ui.perfetto.dev) is not at hand.

    scripts/trace_to_svg.py run.json run.svg
"""

import json
import sys
from html import escape

COLOURS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
           "#ff9da7", "#9c755f", "#bab0ac"]


def render(trace, width=960, row=26, label=150):
    evs = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in evs
             if e["ph"] == "M" and e["name"] == "thread_name"}
    xs = [e for e in evs if e["ph"] == "X"]
    tids = sorted({e["tid"] for e in xs})
    if not xs:
        raise SystemExit("no events in the trace")
    t0 = min(e["ts"] for e in xs)
    t1 = max(e["ts"] + e["dur"] for e in xs)
    scale = (width - label - 10) / max(t1 - t0, 1e-3)
    kinds = sorted({e["name"] for e in xs})
    colour = {k: COLOURS[i % len(COLOURS)] for i, k in enumerate(kinds)}
    legend_rows = (len(kinds) + 2) // 3
    height = row * len(tids) + 40 + 18 * legend_rows
    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" '
           'font-family="sans-serif" font-size="11">' % (width, height),
           '<rect width="100%" height="100%" fill="white"/>']
    for i, tid in enumerate(tids):
        y = 10 + i * row
        out.append('<text x="4" y="%d">%s</text>' % (y + row * 0.6, escape(names.get(tid, str(tid)))))
        out.append('<line x1="%d" x2="%d" y1="%d" y2="%d" stroke="#ddd"/>'
                   % (label, width - 10, y + row - 2, y + row - 2))
        for e in xs:
            if e["tid"] != tid:
                continue
            x = label + (e["ts"] - t0) * scale
            w = max(e["dur"] * scale, 1.0)
            out.append('<rect x="%.1f" y="%d" width="%.1f" height="%d" fill="%s">'
                       '<title>%s: %d bytes, %.3f ms</title></rect>'
                       % (x, y + 3, w, row - 8, colour[e["name"]], escape(e["name"]),
                          e["args"].get("bytes", 0), e["dur"] / 1e3))
    y = 10 + len(tids) * row + 8
    out.append('<text x="%d" y="%d">%.1f ms</text>' % (label, y + 4, 0.0))
    out.append('<text x="%d" y="%d" text-anchor="end">%.1f ms</text>'
               % (width - 10, y + 4, (t1 - t0) / 1e3))
    for i, k in enumerate(kinds):
        lx = label + (i % 3) * 260
        ly = y + 20 + (i // 3) * 18
        out.append('<rect x="%d" y="%d" width="12" height="12" fill="%s"/>' % (lx, ly - 10, colour[k]))
        out.append('<text x="%d" y="%d">%s</text>' % (lx + 16, ly, escape(k)))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    with open(sys.argv[1]) as f:
        svg = render(json.load(f))
    with open(sys.argv[2], "w") as f:
        f.write(svg)


if __name__ == "__main__":
    main()
