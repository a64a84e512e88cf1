"""What ``python -m dmem`` prints: the version, the backend dmem would use and
why, the device, the limits in effect and where each came from, and the
default runtime's statistics when this process has one.

``dmem.report()`` prints the same from inside a program (where the default
runtime may exist); ``python -m dmem`` runs it in a fresh process, which
creates a short-lived runtime from the environment to find the answers.
"""

import os
import sys

from . import _dmem

# The info() keys that show an option's value in effect where it is not the
# option's field name.
_INFO_KEYS = {"host_backend_capacity": "device_capacity"}
_INFO = {"backend", "device", "device_limit", "host_limit", "spill_dir", "eviction_policy",
         "log_level", "print_stats", "host_headroom", "device_capacity", "spill_ahead",
         "spill_ahead_trigger"}
# Variables that are no option of a runtime: (variable, what it sets).
_OTHERS = [("DMEM_TRACE", "trace file"), ("DMEM_FAULT_INJECT", "fault injection (testing)")]


def _variables():
    """(variable, what it sets, the info() key that shows the value in effect
    or None), one per variable of the C library's table of options
    (DMEM_CONFIG_OPTIONS), then the others."""
    out = []
    for o in _dmem._config_options():
        if not o["env"]:
            continue
        key = _INFO_KEYS.get(o["field"], o["field"])
        out.append((o["env"], o["doc"], key if key in _INFO else None))
    return out + [(var, what, None) for var, what in _OTHERS]


def _mib(n):
    return "%d bytes (%.1f MiB)" % (n, n / 1048576.0)


def _value(key, info):
    if key == "spill_ahead":  # its marks in effect are in the statistics
        if not info["spill_ahead_high"]:
            return "off"
        limit = info["device_limit"] or 1
        return "on: above %.0f%% of the limit, down to %.0f%%" % (
            100.0 * info["spill_ahead_high"] / limit, 100.0 * info["spill_ahead_low"] / limit)
    v = info[key]
    if key in ("device_limit", "device_capacity", "host_headroom"):
        return _mib(v)
    if key == "host_limit":
        return _mib(v) if v else "0 (unlimited)"
    if key == "print_stats":
        if not v:
            return "off"
        n = info["stats_interval_s"]
        return "every %d s and at the end" % n if n else "at the end (destroy or exit)"
    return str(v)


def _source(var, environ):
    if environ.get(var):
        return "environment (%s=%s)" % (var, environ[var])
    return "default"


def report(file=None, environ=None):
    """Print the report to file (default sys.stdout). Returns 0, or 1 when
    no runtime can be created from this environment (the reason printed)."""
    out = file if file is not None else sys.stdout
    env = os.environ if environ is None else environ
    version = "%d.%d.%d" % (_dmem.VERSION_MAJOR, _dmem.VERSION_MINOR, _dmem.VERSION_PATCH)
    print("dmem %s (library %s)" % (version, _dmem._library_path()), file=out)
    defaults = _dmem._default_runtimes()
    temporary = None
    if defaults:
        rt = defaults[0]
        print("default runtime: in use in this process", file=out)
    else:
        try:
            temporary = rt = _dmem.Runtime()
        except _dmem.DmemError as e:
            print("no runtime can be made from this environment: %s: %s" % (e.name, e.detail),
                  file=out)
            return 1
        print("default runtime: none in this process (these are what it would get)", file=out)
    try:
        info = rt.info()
        stats = rt.stats()
        info["spill_ahead_high"] = stats["spill_ahead_high"]
        info["spill_ahead_low"] = stats["spill_ahead_low"]
        print("backend: %s (%s)" % (info["backend"], info["backend_reason"]), file=out)
        print("device: %d, capacity %s" % (info["device"], _mib(info["device_capacity"])),
              file=out)
        if info["device_limit_asked"] > info["device_limit"]:
            print("device limit asked: %s, clamped to the capacity"
                  % _mib(info["device_limit_asked"]), file=out)
        print("settings in effect (and where each came from):", file=out)
        for var, what, key in _variables():
            if key is None and not env.get(var):
                continue
            value = _value(key, info) if key else env[var]
            src = _source(var, env)
            if var == "DMEM_DEVICE_LIMIT" and not env.get(var) and not info["device_limit_asked"]:
                src = "default (the device's capacity)"
            if var == "DMEM_SPILL_DIR" and not env.get(var):
                src = "default ($TMPDIR or /tmp)"
            print("  %-26s %-44s %s" % (what, value, src), file=out)
        if defaults:
            print("default runtime statistics:", file=out)
            stats = rt.stats()
            for k in ("device_limit", "device_used", "device_used_peak", "host_used",
                      "host_used_peak", "disk_used", "disk_used_peak", "raw_used",
                      "raw_used_peak", "buffer_count", "spill_count", "bytes_spilled",
                      "unspill_count", "bytes_unspilled", "host_to_disk_pushdowns",
                      "oom_evictions"):
                print("  %-26s %s" % (k, stats[k]), file=out)
    finally:
        if temporary is not None:
            temporary.close()
    return 0
