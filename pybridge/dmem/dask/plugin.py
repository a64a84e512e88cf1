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
- Asks the scheduler to drop this worker's copy of a key it fetched from a
  peer as soon as no task here needs it any more (see ``reduce_replicas``),
  so that those copies do not fill the device and push keys out to host
  memory until the Active Memory Manager's next periodic run (every 2 s by
  default: longer than a whole dmem.dask computation often takes). The
  scheduler drops it only while another worker holds the key (a small
  scheduler plugin, ``DropFetchedReplicas``, that the worker registers);
  where the scheduler cannot load it, the worker asks for one run of the
  AMM's ReduceReplicas instead, which may drop either copy.
- Reports dmem's device, host and disk bytes with every heartbeat
  (``Worker.metrics``: the scheduler's WorkerState.metrics and the
  dashboard's worker table).
- On the CUDA backend, makes CuPy allocate through dmem (``dmem.cupy``), so
  that task results are adopted without a copy and every byte is counted
  once.
- Frees the mapping's buffers when the worker closes.
"""

import functools
import logging
import time

import dask
from distributed import SchedulerPlugin, WorkerPlugin

from . import ipc as _ipc
from .data import DmemWorkerData, for_transfer

__all__ = ["DmemWorkerPlugin", "DropFetchedReplicas"]

logger = logging.getLogger(__name__)

# Task states of a worker's dependents that no longer need their inputs.
_DONE = frozenset({"memory", "released", "forgotten", "error", "cancelled"})

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


class DropFetchedReplicas(SchedulerPlugin):
    """On the scheduler: lets a worker drop its own copies of keys it
    fetched and no longer needs (the ``dmem_drop_fetched`` handler).

    A copy is dropped only while another worker holds the key; the
    scheduler forgets the replica at once and tells the worker
    (``Scheduler.request_remove_replicas``, what the Active Memory Manager
    does for its own drops), so no other drop can take the key's last copy
    meanwhile, and a worker that still needs the key refuses and is put
    back in its who_has. Idempotent: DmemWorkerPlugin registers it from
    every worker."""

    name = "dmem-drop-fetched"

    def __init__(self):
        self.scheduler = None
        self.dropped = 0  # replicas this plugin had dropped

    def start(self, scheduler):
        self.scheduler = scheduler
        scheduler.handlers["dmem_drop_fetched"] = self.drop

    def drop(self, worker=None, keys=()):
        """Drop `worker`'s replicas of `keys` where the rules above allow;
        returns how many."""
        s = self.scheduler
        ws = s.workers.get(worker) if s is not None else None
        if ws is None:
            return 0
        out = []
        for key in keys:
            ts = s.tasks.get(key)
            if ts is None or ts.state != "memory" or not ts.who_has or ws not in ts.who_has:
                continue
            if len(ts.who_has) < 2:
                continue  # the last copy
            # A dependent the scheduler still sees processing there may have
            # finished already (its message not in yet); a worker that does
            # still need the key refuses the drop.
            out.append(key)
        if out:
            s.request_remove_replicas(worker, out, stimulus_id=f"dmem-drop-fetched-{time.time()}")
            self.dropped += len(out)
        return len(out)


class DmemWorkerPlugin(WorkerPlugin):
    name = "dmem"

    # the least time between two ReduceReplicas runs this worker asks for
    REDUCE_REPLICAS_INTERVAL_S = 0.05

    def __init__(self, use_dmem_for_cupy=True, prefetch=True, ipc=None, reduce_replicas=None):
        """ipc: send device arrays to workers of the same machine by CUDA IPC
        (True/False; None: the worker's DMEM_DASK_IPC, default 1).

        reduce_replicas: when a task finishes and a key this worker fetched
        from a peer has no task left here that needs it, ask the scheduler
        (at most every REDUCE_REPLICAS_INTERVAL_S, the keys gathered
        meanwhile together) to drop this worker's copy
        (DropFetchedReplicas), or, where the scheduler cannot load that
        plugin, to run the Active Memory Manager's ReduceReplicas once.
        True/False; None: on when the worker's Dask config starts the AMM
        (``distributed.scheduler.active-memory-manager.start``, Dask's
        default), off when it is turned off."""
        for name, v in (("ipc", ipc), ("reduce_replicas", reduce_replicas)):
            if v is not None and not isinstance(v, bool):
                raise TypeError(f"{name} must be True, False or None, not {v!r}")
        self.use_dmem_for_cupy = use_dmem_for_cupy
        self.prefetch = prefetch
        self.ipc = ipc
        self.reduce_replicas = reduce_replicas
        self._worker = None
        self._reduce = False
        self._reduce_state = "idle"  # "idle", "asking" (a request in flight) or "off"
        self._reduce_again = False
        self._reduce_last = 0.0
        self._stale = set()  # fetched keys no task here needs, not yet asked about
        self._targeted = None  # DropFetchedReplicas registered (None: not tried yet)
        self.replica_requests = 0  # requests this worker made (drops or AMM runs)
        self.replicas_dropped = 0  # copies the scheduler agreed to drop

    def __getstate__(self):  # sent to worker processes: without the worker
        return {"use_dmem_for_cupy": self.use_dmem_for_cupy, "prefetch": self.prefetch,
                "ipc": self.ipc, "reduce_replicas": self.reduce_replicas}

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
        reduce = self.reduce_replicas
        if reduce is None:
            reduce = bool(dask.config.get("distributed.scheduler.active-memory-manager.start",
                                          default=True))
        self._reduce = reduce
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
        if finish == "memory" and start == "executing":
            if self._reduce:
                self._after_task(key)
            return
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

    def _after_task(self, key):
        """A task finished: if one of its inputs is a replica fetched from a
        peer that no task of this worker needs any more, ask for a
        ReduceReplicas run."""
        worker = self._worker
        try:
            ts = worker.state.tasks.get(key)
            stale = [] if ts is None else [
                dep.key for dep in ts.dependencies
                if dep.run_spec is None and dep.state == "memory"
                and all(d.state in _DONE for d in dep.dependents)]
        except Exception:  # the state changed under us: the next task looks again
            return
        if stale:
            self._stale.update(stale)
            self._ask_reduce()

    def _ask_reduce(self):
        if self._reduce_state == "off":
            return
        if self._reduce_state == "asking":
            self._reduce_again = True  # one more run once this one is answered
            return
        self._reduce_state = "asking"
        self._worker.loop.add_callback(self._reduce_replicas)

    async def _reduce_replicas(self):
        import asyncio

        worker = self._worker
        try:
            while worker is not None:
                wait = self._reduce_last + self.REDUCE_REPLICAS_INTERVAL_S - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                self._reduce_again = False
                self._reduce_last = time.monotonic()
                if self._targeted is None:
                    self._targeted = await self._register_dropper(worker)
                keys, self._stale = list(self._stale), set()
                if self._targeted:
                    self.replicas_dropped += await worker.scheduler.dmem_drop_fetched(
                        worker=worker.address, keys=keys)
                else:
                    await worker.scheduler.amm_handler(method="run_once")
                self.replica_requests += 1
                if not self._reduce_again:
                    break
        except Exception as e:  # a scheduler without the AMM, or going away
            if worker is not None and worker.status.name in ("running", "paused"):
                logger.info("dmem.dask: not asking the scheduler to drop replicas any more "
                            "(%s: %s)", type(e).__name__, e)
                self._reduce_state = "off"
                return
        if self._reduce_state == "asking":
            self._reduce_state = "idle"

    @staticmethod
    async def _register_dropper(worker):
        """Register DropFetchedReplicas on the scheduler; False when it
        cannot load it (no dmem there, pickled plugins refused)."""
        try:
            from distributed.protocol.pickle import dumps

            await worker.scheduler.register_scheduler_plugin(
                plugin=dumps(DropFetchedReplicas()), name=DropFetchedReplicas.name,
                idempotent=True)
            return True
        except Exception as e:
            logger.info("dmem.dask: the scheduler cannot drop fetched replicas by name "
                        "(%s: %s); asking for ReduceReplicas runs instead", type(e).__name__, e)
            return False

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
