"""Checks that the Markdown documentation shows only code that is tested and
names only files that exist.

    python check_docs.py REPO_ROOT

For README.md, CHANGELOG.md, docs/*.md and pybridge/README.md:
  1. every fenced code block in C, CUDA or Python is marked by the line
     `<!-- example: examples/FILE [SECTION] -->` just above it, and is the
     text of that section of the file (the lines between two lines that hold
     `[SECTION]` in a comment; no section: the whole file), indentation
     aside. examples/CMakeLists.txt builds and runs every file of examples/
     it names, so each such block is compiled and run by the test suite;
  2. every file or folder of the repository named in backquotes exists;
  3. no text points where a reader cannot follow: issue numbers, "the
     project's design document", folders that are not in the repository.
Prints one line per problem and exits 1 if there is any.
"""

import glob
import os
import re
import sys
import textwrap

CODE_LANGS = {"c", "cuda", "cu", "cpp", "c++", "python", "py", "python3"}
MARK = re.compile(r"^<!--\s*example:\s*(\S+)(?:\s+\[([\w-]+)\])?\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
TOP = ("include/", "runtime/", "pybridge/", "tests/", "bench/", "docs/", "examples/",
       "scripts/", "cmake/", ".ci/")
TOP_FILES = {"README.md", "LICENSE", "CHANGELOG.md", "CMakeLists.txt", "CMakePresets.json",
             "pyproject.toml"}
FORBIDDEN = [
    (re.compile(r"\bissues? #?\d+", re.I), "an issue number (not in the repository)"),
    (re.compile(r"design document", re.I), "a design document outside the repository"),
    (re.compile(r"\.whl/calls|<shared>|anchors\.md"), "a file outside the repository"),
]


def section(path, name):
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    if not name:
        return lines
    tag = re.compile(r"^\s*(/\*|//|#)\s*\[" + re.escape(name) + r"\]")
    at = [i for i, ln in enumerate(lines) if tag.match(ln)]
    if len(at) != 2:
        return None
    return lines[at[0] + 1:at[1]]


def norm(lines):
    return textwrap.dedent("\n".join(ln.rstrip() for ln in lines)).strip("\n")


def check_file(root, md, problems, examples_cmake):
    rel = os.path.relpath(md, root)
    with open(md, encoding="utf-8") as f:
        lines = f.read().splitlines()
    i = 0
    prev = ""  # last non-blank line outside code
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if lines[i].strip():
                prev = lines[i].strip()
                check_prose(root, rel, i + 1, lines[i], problems)
            i += 1
            continue
        fence, lang, start = m.group(2), m.group(3).lower(), i
        i += 1
        body = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1
        where = f"{rel}:{start + 1}"
        if lang not in CODE_LANGS:
            for ln in body:
                for rx, why in FORBIDDEN:
                    if rx.search(ln):
                        problems.append(f"{where}: block names {why}: {ln.strip()}")
            prev = ""
            continue
        mk = MARK.match(prev)
        if not mk:
            problems.append(f"{where}: ```{lang} block without <!-- example: examples/FILE "
                            "[SECTION] --> above it: its code is not compiled or run by any test")
            prev = ""
            continue
        path, name = mk.group(1), mk.group(2)
        prev = ""
        full = os.path.join(root, path)
        if not path.startswith("examples/") or not os.path.isfile(full):
            problems.append(f"{where}: {path} is not a file in examples/")
            continue
        if os.path.basename(path) not in examples_cmake:
            problems.append(f"{where}: {path} is not built or run by examples/CMakeLists.txt")
        want = section(full, name)
        if want is None:
            problems.append(f"{where}: {path} has no section [{name}] (two marker lines)")
        elif norm(want) != norm(body):
            problems.append(f"{where}: the block differs from {path}" +
                            (f" [{name}]" if name else "") + ": copy the example's text")


PATHLIKE = re.compile(r"`([^`\s]+)`")


def check_prose(root, rel, n, line, problems):
    for rx, why in FORBIDDEN:
        if rx.search(line):
            problems.append(f"{rel}:{n}: names {why}")
    if line.lstrip().startswith("<!--"):
        return
    for tok in PATHLIKE.findall(line):
        p = re.split(r"::|:\d|,", tok)[0].rstrip(".;)")
        if "<" in p or "$" in p or p.startswith("build/"):
            continue
        if not (p.startswith(TOP) or p in TOP_FILES):
            continue
        if any(c in p for c in "*?["):
            if not glob.glob(os.path.join(root, p)):
                problems.append(f"{rel}:{n}: `{tok}` matches no file in the repository")
        elif not os.path.exists(os.path.join(root, p)):
            problems.append(f"{rel}:{n}: `{tok}` is not in the repository")


def main(root):
    files = [os.path.join(root, f) for f in ("README.md", "CHANGELOG.md")]
    # docs/benchmarks.md is not checked yet: it still names issue numbers and
    # files kept outside the repository (its owner is rewriting it)
    files += sorted(f for f in glob.glob(os.path.join(root, "docs", "*.md"))
                    if os.path.basename(f) != "benchmarks.md")
    files.append(os.path.join(root, "pybridge", "README.md"))
    with open(os.path.join(root, "examples", "CMakeLists.txt"), encoding="utf-8") as f:
        cm = f.read()
    # the names a CMake line builds or runs: "saxpy_host.c", and "python_buffers"
    # from a foreach list of Python examples run as ${name}.py
    examples_cmake = set(re.findall(r"[\w-]+\.(?:c|cu|py)\b", cm))
    for lst in re.findall(r"foreach\(name ([^)]*)\)", cm):
        examples_cmake |= {w + ".py" for w in lst.split()}
    problems = []
    for md in files:
        if os.path.exists(md):
            check_file(root, md, problems, examples_cmake)
    for p in problems:
        print(p)
    print(f"check_docs: {len(files)} Markdown files, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
