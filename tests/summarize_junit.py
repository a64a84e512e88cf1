"""Print one preset's part of scripts/test's summary from CTest's JUnit file.

    python summarize_junit.py PRESET JUNIT.xml BUILD_DIR

Counts the tests, then lists every skipped test with its reason (the
"SKIP: ..." line of a C test that exited 77, the "dmem-pytest skipped: ..."
lines of a Python file whose tests all skipped), and the Python files that
passed with some of their tests skipped (each skipped test with its reason).
Says so when the Python tests were not built at all.
"""

import os
import re
import sys
import xml.etree.ElementTree as ET

PYSKIP = re.compile(r"^dmem-pytest skipped: (.*)$", re.M)
CSKIP = re.compile(r"^SKIP: (.*)$", re.M)


def reasons(out):
    rs = PYSKIP.findall(out) or CSKIP.findall(out)
    if not rs:
        lines = [ln for ln in out.strip().splitlines() if ln.strip()]
        rs = [lines[-1].strip() if lines else "no reason printed"]
    return rs


def main(preset, path, build):
    if not os.path.exists(path):
        print(f"{preset}: no results ({path} missing: the build or ctest did not run)")
        return 1
    root = ET.parse(path).getroot()
    cases = root.iter("testcase")
    n = passed = failed = 0
    skipped, partly = [], []
    for c in cases:
        n += 1
        name = c.get("name")
        out = "".join(e.text or "" for e in c.iter("system-out"))
        status = c.get("status", "")
        if c.find("skipped") is not None or status in ("notrun", "disabled"):
            skipped.append((name, reasons(out)))
        elif c.find("failure") is not None or c.find("error") is not None or status == "fail":
            failed += 1
        else:
            passed += 1
            inner = PYSKIP.findall(out)
            if inner:
                partly.append((name, inner))
    print(f"{preset}: {n} tests: {passed} passed, {failed} failed, {len(skipped)} skipped")
    # tests skipped for the same one reason (the CUDA tests without a device)
    # are listed together
    by_reason = {}
    for name, rs in skipped:
        if len(rs) == 1:
            by_reason.setdefault(rs[0], []).append(name)
        else:
            print(f"  skipped  {name} ({len(rs)} tests):")
            for r in rs:
                print(f"             {r}")
    for reason, names in by_reason.items():
        if len(names) == 1:
            print(f"  skipped  {names[0]}: {reason}")
        else:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            print(f"  skipped  {len(names)} tests ({shown}): {reason}")
    for name, rs in partly:
        print(f"  passed   {name}, but {len(rs)} of its tests skipped:")
        for r in rs:
            print(f"             {r}")
    pydir = os.path.join(build, "python", "dmem")
    built = os.path.isdir(pydir) and any(f.startswith("_dmem") for f in os.listdir(pydir))
    if preset == "default" and not built:
        print("  not built: the Python extension and its tests (no python3 headers: "
              "python3-dev on Debian/Ubuntu)")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
