"""dmem.dask.DmemWorkerPlugin: what a dmem worker needs beside its mapping.

- Tells the mapping its worker, so that keys needed by ready and executing
  tasks count as hot when dmem chooses spill victims.
- When a task starts, prefetches the spilled inputs of the next tasks in the
  ready queue (as many as the worker has threads), so that their copies
  back to the device overlap the running tasks.
- Makes ``get_data`` (values asked for by other workers and clients) hand
  out DmemValue objects, sent from where their bytes are; device arrays
  asked for by another worker of the same machine go by CUDA IPC
  (dmem.dask.ipc), locked on the device until that worker has
  acknowledged them.
- Reports dmem's device, host and disk bytes with every heartbeat
  (``Worker.metrics``: the scheduler's WorkerState.metrics and the
  dashboard's worker table).
- On the CUDA backend, makes CuPy allocate through dmem (``dmem.cupy``), so
  that task results are adopted without a copy and every byte is counted
  once.
- Frees the mapping's buffers when the worker closes.
"""

import functools

from distributed import WorkerPlugin

from . import ipc as _ipc
from .data import DmemWorkerData, for_transfer

__all__ = ["DmemWorkerPlugin"]

METRICS = (
    "dmem-device-bytes",
    "dmem-host-bytes",
    "dmem-disk-bytes",
    "dmem-spilled-bytes",
    "dmem-unspilled-bytes",
    "dmem-spill-count",
    "dmem-device-keys",
    "dmem-adopted",
    "dmem-copied",
    "dmem-prefetched",
)


class DmemWorkerPlugin(WorkerPlugin):
    name = "dmem"

    def __init__(self, use_dmem_for_cupy=True, prefetch=True, ipc=None):
        """ipc: send device arrays to workers of the same machine by CUDA IPC
        (True/False; None: the worker's DMEM_DASK_IPC, default 1)."""
        if ipc not in (None, True, False):
            raise TypeError(f"ipc must be True, False or None, not {ipc!r}")
        self.use_dmem_for_cupy = use_dmem_for_cupy
        self.prefetch = prefetch
        self.ipc = ipc
        self._worker = None

    def __getstate__(self):  # sent to worker processes: without the worker
        return {"use_dmem_for_cupy": self.use_dmem_for_cupy, "prefetch": self.prefetch,
                "ipc": self.ipc}

    def __setstate__(self, d):
        self.__init__(**d)

    def setup(self, worker):
        data = worker.data
        if not isinstance(data, DmemWorkerData):
            raise TypeError("DmemWorkerPlugin needs a worker whose data is a DmemWorkerData, "
                            f"not {type(data).__name__}")
        ipc = _ipc.enabled_by_default() if self.ipc is None else self.ipc
        data.attach(worker)
        self._worker = worker
        handler = worker.handlers["get_data"]
        if not getattr(handler, "_dmem", False):

            @functools.wraps(handler)  # the same signature: the server reads it
            async def get_data(*args, **kwargs):
                comm = args[0] if args else kwargs.get("comm")
                transfer = _ipc.Transfer.for_call(data.runtime, ipc, comm, kwargs.get("who"))
                token = for_transfer.set(transfer)
                try:
                    # returns once the asking worker has read (and, for IPC,
                    # copied) the values and answered "OK"
                    return await handler(*args, **kwargs)
                finally:
                    for_transfer.reset(token)
                    transfer.release()

            get_data._dmem = True
            worker.handlers["get_data"] = get_data
        for name in METRICS:
            worker.metrics[name] = _metric(name)
        if self.use_dmem_for_cupy and data.runtime.backend == "cuda" and data.runtime.is_default:
            try:
                from dmem.cupy import use_dmem_for_cupy

                use_dmem_for_cupy()
            except ImportError:
                pass

    def transition(self, key, start, finish, **kwargs):
        if finish != "executing" or not self.prefetch:
            return
        worker = self._worker
        data = getattr(worker, "data", None) if worker is not None else None
        if not isinstance(data, DmemWorkerData):
            return
        try:
            state = worker.state
            upcoming = state.ready.peekn(max(1, state.nthreads))
            keys = [dep.key for ts in upcoming for dep in ts.dependencies]
        except Exception:  # the state changed under us: nothing to prefetch
            return
        if keys:
            data.prefetch(keys)

    def teardown(self, worker):
        data = worker.data
        self._worker = None
        if isinstance(data, DmemWorkerData):
            data.attach(None)
            data.close()


def _metric(name):
    def get(worker):
        data = worker.data
        return data.metrics()[name] if isinstance(data, DmemWorkerData) else 0

    return get
