#!/usr/bin/env python3
"""Check that dmem's C files only call down the layers of a layer table.

Usage: check_layers.py NM BUILD_DIR TABLE

Reads every object file under BUILD_DIR that was built from a source under
one of the table's paths (CMake's CMakeFiles/<target>.dir/<source>.o layout),
maps each undefined symbol to the file that defines it, and fails (exit 1)
when a file calls into a layer above its own, when files call each other in
a circle of any length (a -> b -> a, a -> b -> c -> a, ...: the strongly
connected components of the file call graph; each is printed as one circle
with the function that makes each step, and the component's other files), or
when a source file has no layer."""
import collections
import os
import re
import subprocess
import sys


def read_table(path):
    layers = []  # (name, [prefixes]) bottom first
    public_only = set()  # ranks that may call only public dmem_* functions
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].split()
            if line:
                if len(line) > 1 and line[1] == "public":
                    public_only.add(len(layers))
                    line = [line[0]] + line[2:]
                layers.append((line[0], line[1:]))
    return layers, public_only


def layer_of(src, layers):
    best, best_len = None, -1
    for rank, (_, paths) in enumerate(layers):
        for p in paths:
            hit = src.startswith(p) if p.endswith("/") else src == p
            if hit and len(p) > best_len:
                best, best_len = rank, len(p)
    return best


def objects(build, layers, source_root):
    prefixes = [p for _, paths in layers for p in paths]
    found = {}
    for root, _, files in os.walk(build):
        for f in files:
            if not f.endswith(".o"):
                continue
            rel = os.path.relpath(os.path.join(root, f), build)
            m = re.match(r"(?:.*?/)?CMakeFiles/[^/]+\.dir/(.+)\.o$", rel)
            if not m:
                continue
            src = m.group(1)
            # pybridge's objects are built from pybridge/ (a subdirectory)
            sub = rel.split("/CMakeFiles/")[0] if "/CMakeFiles/" in rel else ""
            if sub and not src.startswith(sub + "/"):
                src = sub + "/" + src
            # an object whose source was removed since is stale, not code
            if not os.path.exists(os.path.join(source_root, src)):
                continue
            if any(src.startswith(p) or src == p for p in prefixes):
                found.setdefault(src, os.path.join(root, f))
    return found


def describe_circle(comp, edges, via):
    """One shortest circle through the first file of a strongly connected
    component, as 'a.c -> b.c (sym) -> ... -> a.c (sym)', and the component's
    files that the circle does not pass through."""
    members = set(comp)
    start = comp[0]
    prev = {}
    queue = collections.deque([start])
    end = None
    while queue and end is None:
        v = queue.popleft()
        for w in sorted(edges[v]):
            if w not in members:
                continue
            if w == start:
                end = v
                break
            if w not in prev:
                prev[w] = v
                queue.append(w)
    path = [end]
    while path[-1] != start:
        path.append(prev[path[-1]])
    path.reverse()
    path.append(start)
    text = path[0] + "".join(f" -> {b} ({via[(a, b)]})" for a, b in zip(path, path[1:]))
    rest = sorted(members - set(path))
    if rest:
        text += f"; in the same circle of {len(comp)} files also: " + ", ".join(rest)
    return text


def main():
    nm, build, table = sys.argv[1:4]
    layers, public_only = read_table(table)
    source_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(table))))
    objs = objects(build, layers, source_root)
    if not objs:
        print(f"no objects under {build} for the table's paths: build first")
        return 1
    defined, undefined = {}, collections.defaultdict(set)
    for src, path in sorted(objs.items()):
        out = subprocess.run([nm, path], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1] in "TDBRCG":
                defined[parts[2]] = src
            elif len(parts) == 2 and parts[0] == "U":
                undefined[src].add(parts[1])
    errors = []
    rank = {}
    for src in objs:
        rank[src] = layer_of(src, layers)
        if rank[src] is None:
            errors.append(f"{src}: in no layer of {table}")
    edges = collections.defaultdict(set)
    via = {}  # (caller, callee) -> the first symbol (sorted) that makes the call
    for src, syms in sorted(undefined.items()):
        for s in sorted(syms):
            d = defined.get(s)
            if not d or d == src:
                continue
            edges[src].add(d)
            via.setdefault((src, d), s)
            if rank[src] is not None and rank[d] is not None and rank[d] > rank[src]:
                errors.append(f"{src} ({layers[rank[src]][0]}) calls {s} of {d} "
                              f"({layers[rank[d]][0]}), a higher layer")
            elif (rank[src] in public_only and rank[d] not in public_only
                  and s.startswith("dmem__")):
                errors.append(f"{src} ({layers[rank[src]][0]}) calls {s} of {d}, "
                              f"an internal function (public API only)")
    # circles: strongly connected components (Tarjan)
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(objs):
        if v not in index:
            strong(v)
    for c in circles:
        errors.append("file circle: " + describe_circle(c, edges, via))
    for e in errors:
        print("layers:", e)
    nedges = sum(len(v) for v in edges.values())
    per_layer = collections.Counter(layers[r][0] for r in rank.values() if r is not None)
    print(f"layers: {len(objs)} files ({', '.join(f'{n} {per_layer[n]}' for n, _ in layers)}), "
          f"{nedges} call edges, {len(errors)} problems")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
