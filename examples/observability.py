"""examples/observability.py - what dmem tells about a run: peaks over one
phase (stats(reset_peaks=True)), and a run worth a DMEM_TRACE look
(docs/observability.md).

    DMEM_TRACE=run.json DMEM_LOG=info PYTHONPATH=build/default/python \
        python3 examples/observability.py

Runs on the host backend (it asks for it); run.json then opens in
ui.perfetto.dev.
"""
import os
import shutil
import tempfile

import dmem

scratch = tempfile.mkdtemp()
os.environ.setdefault("DMEM_SPILL_DIR", scratch)
try:
    # [trace]
    with dmem.Runtime(backend="host", host_capacity="64Mi", host_limit="16Mi") as rt:
        s = rt.stream()
        bufs = [rt.alloc(8 << 20) for _ in range(8)]   # the device is full
        more = [rt.alloc(8 << 20) for _ in range(4)]   # on-demand evictions; push-downs to disk
        for b in bufs:
            with b.lock(stream=s):                      # the spilled ones come back: lock waits
                pass
        s.close()
    # [trace]

    rt = dmem.Runtime(backend="host", host_capacity="64Mi")

    def run_phase():
        held = [rt.alloc(4 << 20) for _ in range(3)]
        for b in held:
            b.free()

    # [peaks]
    rt.stats(reset_peaks=True)
    run_phase()
    print(rt.stats()["device_used_peak"])
    # [peaks]
    assert rt.stats()["device_used_peak"] == 12 << 20
    rt.close()
    print("observability: OK")
finally:
    shutil.rmtree(scratch, ignore_errors=True)
