"""CTest's wrapper around pytest for one test file (tests/python/CMakeLists.txt).

    python run_pytest.py tests/python/test_x.py

Runs pytest on the file with its temporary folders (tmp_path) in a fresh
folder under $TMPDIR that it removes afterwards, prints pytest's report, then
one line per skipped test ("dmem-pytest skipped: <test>: <reason>") and a
count line. Exit status: pytest's when a test failed or errored; 77 (CTest's
SKIP_RETURN_CODE) when nothing ran but skips, so that a file whose tests all
skip is reported as skipped, not passed; 0 when at least one test passed and
none failed.
"""

import os
import shutil
import sys
import tempfile

import pytest

SKIP = 77


class Outcomes:
    def __init__(self):
        self.passed = 0
        self.failed = 0
        self.skipped = []  # (test, reason)

    @staticmethod
    def _reason(report):
        lr = report.longrepr
        if isinstance(lr, tuple) and len(lr) == 3:
            reason = lr[2]
        else:
            reason = str(lr)
        return reason.removeprefix("Skipped: ")

    def pytest_collectreport(self, report):
        if report.failed:
            self.failed += 1
        elif report.skipped:  # a module skipped as a whole (importorskip)
            self.skipped.append((report.nodeid or "module", self._reason(report)))

    def pytest_runtest_logreport(self, report):
        if report.when == "call" and report.passed:
            self.passed += 1
        elif report.failed:
            self.failed += 1
        elif report.skipped and report.when in ("setup", "call"):
            self.skipped.append((report.nodeid, self._reason(report)))


def main(argv):
    if len(argv) < 2:
        print("usage: run_pytest.py TEST_FILE [pytest options]", file=sys.stderr)
        return 2
    base = tempfile.mkdtemp(prefix="dmem-pytest-")
    out = Outcomes()
    try:
        rc = pytest.main(["-q", "-rs", "-p", "no:cacheprovider", f"--basetemp={base}", *argv[1:]],
                         plugins=[out])
    finally:
        shutil.rmtree(base, ignore_errors=True)
    sys.stdout.flush()
    for test, reason in out.skipped:
        print(f"dmem-pytest skipped: {test}: {reason}")
    print(f"dmem-pytest: {out.passed} passed, {out.failed} failed, {len(out.skipped)} skipped")
    if rc not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED) or out.failed:
        return int(rc) or 1
    if out.passed == 0:
        print("dmem-pytest: no test ran (all skipped): reported as skipped")
        return SKIP
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
