"""What dmem tells about itself (issue 23): an explicit keyword against a
malformed DMEM_* variable, the backend's reason, per-runtime log levels,
peaks and their reset, DMEM_STATS at exit for the default runtime,
``python -m dmem``, and the DMEM_TRACE file."""

import json
import os
import subprocess
import sys

import pytest

import dmem
from conftest import CAPACITY, run_python


def _env(extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DMEM_")}
    env.update(extra)
    return env


# ---- configuration ----------------------------------------------------------------


def test_keyword_wins_over_malformed_variable(monkeypatch, spill_dir, capfd):
    monkeypatch.setenv("DMEM_DEVICE_LIMIT", "abc")
    monkeypatch.setenv("DMEM_LOG", "loud")
    with pytest.raises(dmem.ConfigError) as e:
        dmem.Runtime(backend="host", host_capacity=CAPACITY, spill_dir=str(spill_dir))
    assert "DMEM_DEVICE_LIMIT" in e.value.detail
    rt = dmem.Runtime(backend="host", host_capacity=CAPACITY, spill_dir=str(spill_dir),
                      device_limit="4Mi", log_level="error")
    try:
        assert rt.stats()["device_limit"] == 4 << 20
        assert rt.log_level == "error"
    finally:
        rt.close()
    err = capfd.readouterr().err
    # warned at the level given (error): nothing; at warn it says which
    assert "DMEM_DEVICE_LIMIT" not in err
    # log_level "warn" is the default's value: DMEM_LOG=loud is an error again
    with pytest.raises(dmem.ConfigError) as e:
        dmem.Runtime(backend="host", host_capacity=CAPACITY, spill_dir=str(spill_dir),
                     device_limit="4Mi", log_level="warn")
    assert "DMEM_LOG" in e.value.detail
    monkeypatch.delenv("DMEM_LOG")
    rt = dmem.Runtime(backend="host", host_capacity=CAPACITY, spill_dir=str(spill_dir),
                      device_limit="4Mi")
    rt.close()
    err = capfd.readouterr().err
    assert 'DMEM_DEVICE_LIMIT="abc" is malformed: ignored' in err


def test_keyword_wins_over_wellformed_variable(monkeypatch, spill_dir):
    monkeypatch.setenv("DMEM_DEVICE_LIMIT", "6Mi")
    with dmem.Runtime(backend="host", host_capacity=CAPACITY, spill_dir=str(spill_dir)) as rt:
        assert rt.stats()["device_limit"] == 6 << 20
    with dmem.Runtime(backend="host", host_capacity=CAPACITY, spill_dir=str(spill_dir),
                      device_limit="2Mi") as rt:
        assert rt.stats()["device_limit"] == 2 << 20


def test_unusable_spill_dir_refused_at_creation(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"x")
    with pytest.raises(dmem.SpillIOError):
        dmem.Runtime(backend="host", host_capacity=CAPACITY, spill_dir=str(f))
    with pytest.raises(dmem.SpillIOError):
        dmem.Runtime(backend="host", host_capacity=CAPACITY, spill_dir=str(tmp_path / "no" / "x"))


def test_limit_above_capacity_clamped(spill_dir):
    with dmem.Runtime(backend="host", host_capacity=CAPACITY, spill_dir=str(spill_dir),
                      device_limit=4 * CAPACITY) as rt:
        info = rt.info()
        assert info["device_limit"] == CAPACITY
        assert info["device_limit_asked"] == 4 * CAPACITY
        assert rt.stats()["device_limit"] == CAPACITY


# ---- backend reason, log level ------------------------------------------------------


def test_backend_reason_attribute_repr_and_info(spill_dir):
    with dmem.Runtime(backend="host", host_capacity=CAPACITY, spill_dir=str(spill_dir)) as rt:
        assert rt.backend_reason == "backend host asked for"
        assert "backend host asked for" in repr(rt)
        info = rt.info()
        assert info["backend"] == "host" and info["backend_reason"] == rt.backend_reason
        assert info["device_capacity"] == CAPACITY and info["spill_dir"] == str(spill_dir)
    assert rt.backend_reason == "backend host asked for"  # kept after close
    with dmem.Runtime(backend="auto", host_capacity=CAPACITY, spill_dir=str(spill_dir)) as rt:
        if rt.backend == "host":  # no usable CUDA here: the reason says what CUDA said
            assert rt.backend_reason.startswith("backend auto: CUDA not usable (")
            assert rt.backend_reason.endswith("), using the host backend")
        else:
            assert rt.backend_reason.startswith("backend auto: CUDA device")


def test_log_level_keyword_and_property(spill_dir, capfd):
    with dmem.Runtime(backend="host", host_capacity=CAPACITY, spill_dir=str(spill_dir),
                      log_level="info") as rt:
        assert rt.log_level == "info"
        rt.log_level = 0
        assert rt.log_level == "off"
        rt.log_level = "debug"
        assert rt.log_level == "debug"
        with pytest.raises(ValueError):
            rt.log_level = "loud"
        with pytest.raises(ValueError):
            rt.log_level = 5
        with pytest.raises(TypeError):
            rt.log_level = 1.5
        assert rt.log_level == "debug"
        rt.log_level = "info"
        b = rt.alloc(1 << 16)
        for _ in range(30):
            b.spill("host")
            with b.lock():
                pass
        b.free()
    err = capfd.readouterr().err
    assert "dmem[info]: backend host asked for" in err
    lines = [l for l in err.splitlines() if " spills (" in l]
    assert 1 <= len(lines) <= 3, err  # a summary, not a line per buffer
    with pytest.raises(ValueError):
        dmem.Runtime(backend="host", host_capacity=CAPACITY, log_level="chatty")


def test_configure_takes_log_level():
    r = run_python(
        """
        import dmem
        dmem.configure(backend="host", host_capacity="8Mi", log_level="info")
        rt = dmem.default_runtime()
        print(rt.log_level, rt.backend_reason)
        """,
        env_extra={"DMEM_LOG": "off"},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "info"
    assert "dmem[info]: backend host asked for" in r.stderr


# ---- peaks ---------------------------------------------------------------------------


def test_stats_peaks_and_reset(rt):
    bufs = [rt.alloc(1 << 20) for _ in range(3)]
    bufs[0].spill("host")
    raw = rt.device_malloc(1 << 19)
    for b in bufs:
        b.free()
    raw.free()
    s = rt.stats(reset_peaks=True)
    assert s["device_used"] == 0
    assert s["device_used_peak"] == 3 << 20
    assert s["host_used_peak"] == 1 << 20
    assert s["raw_used_peak"] == 1 << 19
    s = rt.stats()
    assert s["device_used_peak"] == 0 and s["host_used_peak"] == 0 and s["raw_used_peak"] == 0
    b = rt.alloc(1 << 20)
    assert rt.stats()["device_used_peak"] == 1 << 20
    b.free()
    with pytest.raises(TypeError):
        rt.stats(True)  # keyword only


# ---- DMEM_STATS, python -m dmem, DMEM_TRACE -------------------------------------------


def test_stats_printed_at_exit_for_default_runtime():
    r = run_python(
        """
        import dmem
        rt = dmem.default_runtime()
        b = rt.alloc(3 << 20)
        """,
        env_extra={"DMEM_STATS": "1", "DMEM_BACKEND": "host", "DMEM_HOST_CAPACITY": "64Mi"},
    )
    assert r.returncode == 0, r.stderr
    assert "dmem stats (host backend, at exit)" in r.stderr
    # the buffer went with the interpreter before the C exit handler: its peak stays
    assert "peaks: device 3145728" in r.stderr


def _python_m_dmem(extra, pre=None):
    env = _env(extra)
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(dmem.__file__)))
    env["PYTHONPATH"] = pkg_parent
    return subprocess.run([sys.executable, "-m", "dmem"], capture_output=True, text=True,
                          env=env, timeout=120)


def test_python_m_dmem():
    r = _python_m_dmem({"DMEM_BACKEND": "host", "DMEM_DEVICE_LIMIT": "8Mi",
                        "DMEM_HOST_CAPACITY": "64Mi"})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith("dmem %s " % dmem.__version__)
    assert "backend: host (backend host asked for)" in out
    assert "device: 0, capacity 67108864 bytes" in out
    lines = {l.split()[0] + " " + l.split()[1]: l for l in out.splitlines() if l.startswith("  ")}
    assert "8388608 bytes" in lines["device limit"]
    assert "environment (DMEM_DEVICE_LIMIT=8Mi)" in lines["device limit"]
    assert "default" in lines["host limit"] and "unlimited" in lines["host limit"]
    assert lines["log level"].rstrip().endswith("default")
    # spill-ahead: off on the host backend unless asked; the marks in effect
    ahead = next(l for l in out.splitlines() if l.startswith("  spill-ahead"))
    assert ahead.split()[1] == "off" and ahead.rstrip().endswith("default")
    assert "default runtime: none in this process" in out
    r = _python_m_dmem({"DMEM_BACKEND": "host", "DMEM_SPILL_AHEAD": "80%,50%",
                        "DMEM_HOST_CAPACITY": "64Mi"})
    assert r.returncode == 0, r.stderr
    line = next(l for l in r.stdout.splitlines() if l.startswith("  spill-ahead"))
    assert "on: above 80% of the limit, down to 50%" in line
    assert "environment (DMEM_SPILL_AHEAD=80%,50%)" in line
    # and the trigger in effect (dmem_runtime_info)
    trigger = next(l for l in r.stdout.splitlines() if l.startswith("  spill-ahead trigger"))
    assert trigger.split()[2] == "demand" and trigger.rstrip().endswith("default"), trigger
    r = _python_m_dmem({"DMEM_BACKEND": "host", "DMEM_SPILL_AHEAD_TRIGGER": "always",
                        "DMEM_HOST_CAPACITY": "64Mi"})
    assert r.returncode == 0, r.stderr
    trigger = next(l for l in r.stdout.splitlines() if l.startswith("  spill-ahead trigger"))
    assert trigger.split()[2] == "always", trigger
    assert "environment (DMEM_SPILL_AHEAD_TRIGGER=always)" in trigger
    # auto: the reason names what CUDA said (or the device)
    r = _python_m_dmem({"DMEM_HOST_CAPACITY": "64Mi"})
    assert r.returncode == 0, r.stderr
    assert "backend: " in r.stdout and "(backend auto: CUDA " in r.stdout
    # a malformed variable: said, exit status 1
    r = _python_m_dmem({"DMEM_DEVICE_LIMIT": "abc"})
    assert r.returncode == 1
    assert "DMEM_ERR_CONFIG" in r.stdout and "DMEM_DEVICE_LIMIT" in r.stdout


def test_report_shows_default_runtime_stats():
    r = run_python(
        """
        import dmem
        rt = dmem.default_runtime()
        b = rt.alloc(1 << 20)
        dmem.report()
        """,
        env_extra={"DMEM_BACKEND": "host", "DMEM_HOST_CAPACITY": "64Mi"},
    )
    assert r.returncode == 0, r.stderr
    assert "default runtime: in use in this process" in r.stdout
    assert "default runtime statistics:" in r.stdout
    stats = dict(l.split() for l in r.stdout.split("default runtime statistics:")[1].splitlines()
                 if l.strip())
    assert stats["device_used"] == str(1 << 20) and stats["buffer_count"] == "1"


def test_trace_file(tmp_path):
    path = tmp_path / "trace.json"
    r = run_python(
        """
        import dmem
        rt = dmem.Runtime(backend="host", host_capacity="8Mi", host_limit="1Mi",
                          spill_dir=%r)
        s = rt.stream()
        bufs = [rt.alloc(3 << 19) for _ in range(5)]
        extra = rt.alloc(2 << 20)          # no room: evictions, a wait
        bufs[4].spill("host")
        for b in bufs:
            with b.lock(stream=s):         # the spilled ones wait for a retrieve
                pass
        # no close: the file is written at exit too
        """ % str(tmp_path),
        env_extra={"DMEM_TRACE": str(path)},
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(path.read_text())
    evs = doc["traceEvents"]
    tracks = {e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"tier: device", "tier: host", "tier: disk"} <= tracks
    assert any(t.startswith("stream 0x") for t in tracks)
    names = {e["name"] for e in evs if e["ph"] == "X"}
    assert {"spill", "unspill", "lock wait", "evict (on demand)",
            "allocation waited for room"} <= names, names
    assert "push-down" in names or "write to disk" in names, names
    for e in evs:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0 and e["args"]["bytes"] > 0
    # the docs' drawing of it: a box per event, a row per track
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "trace_to_svg.py")
    svg = tmp_path / "trace.svg"
    subprocess.run([sys.executable, script, str(path), str(svg)], check=True, timeout=60)
    import xml.etree.ElementTree as ET
    root = ET.parse(svg).getroot()
    boxes = [el for el in root if el.tag.endswith("rect") and el.find("{*}title") is not None]
    assert len(boxes) == sum(1 for e in evs if e["ph"] == "X")
