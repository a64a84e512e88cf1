"""python -m dmem: the version, the backend dmem would use and why, the
device, the limits in effect and where each came from (dmem._report)."""

import sys

from ._report import report

sys.exit(report())
