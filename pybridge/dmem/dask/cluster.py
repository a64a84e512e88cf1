"""dmem.dask.LocalCluster: distributed.LocalCluster with dmem workers.

One worker process (a Nanny) per GPU, each seeing its own GPU first
(``CUDA_VISIBLE_DEVICES`` rotated), each with a DmemWorkerData mapping and
the DmemWorkerPlugin. The GPUs are those this process was given, as
dask-cuda places them: with ``CUDA_VISIBLE_DEVICES=2,3`` in the parent (a
batch system's allocation), worker 0 gets ``2,3`` and worker 1 ``3,2``; the
variable may name GPUs by index or by UUID, and ``devices=`` indexes into
that list. Without a GPU (or with ``backend="host"``) it starts
``n_workers`` (default 2) processes on dmem's host backend, so that the same
code runs in CI.
"""

import copy
import ctypes
import os

import distributed
from distributed import Nanny

from .data import RUNTIME_OPTIONS, DmemWorkerData, check_runtime_options
from .plugin import DmemWorkerPlugin

__all__ = ["LocalCluster", "cuda_masks", "default_host_limit", "derived_host_options",
           "gpu_count", "parent_devices", "select_devices", "visible_devices", "worker_options"]


def gpu_count():
    """GPUs this process may use, without creating a CUDA context (NVML,
    else the driver's cuDeviceGetCount); 0 when there is no driver."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None and env.strip() in ("", "-1"):
        return 0
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            n = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
        if env is not None:
            n = min(n, len([d for d in env.split(",") if d.strip()]))
        return n
    except Exception:
        pass
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        if cuda.cuInit(0) != 0:
            return 0
        n = ctypes.c_int(0)
        if cuda.cuDeviceGetCount(ctypes.byref(n)) != 0:
            return 0
        return n.value
    except OSError:
        return 0


def parent_devices():
    """The GPUs this process was given, as names for CUDA_VISIBLE_DEVICES
    (strings, in order): the entries of this process's
    ``CUDA_VISIBLE_DEVICES`` (indices such as ``"2"`` or UUIDs such as
    ``"GPU-8f3c..."``/``"MIG-..."``), at most as many as CUDA sees; without
    the variable, ``"0"`` to ``"N-1"`` for the N GPUs of the machine."""
    n = gpu_count()
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return [str(i) for i in range(n)]
    names = []
    for d in env.split(","):
        d = d.strip()
        if not d:
            continue
        names.append(str(int(d)) if d.isdigit() else d)
    return names[:n]


def select_devices(devices, visible):
    """The GPUs to use, as names for CUDA_VISIBLE_DEVICES: ``visible`` (the
    parent's, parent_devices()) when devices is None; else devices[i] is an
    index into visible (an int, or a string of digits) or a GPU UUID
    (``"GPU-..."``/``"MIG-..."``, used as it is). Raises ValueError for an
    index out of range or anything else."""
    if devices is None:
        return list(visible)
    if isinstance(devices, (str, int)):
        devices = [d for d in str(devices).split(",") if d.strip()]
    out = []
    for d in devices:
        if isinstance(d, str) and d.strip().upper().startswith(("GPU-", "MIG-")):
            out.append(d.strip())
            continue
        try:
            if isinstance(d, bool):
                raise TypeError
            i = int(d.strip()) if isinstance(d, str) else int(d)
            if i != d and not isinstance(d, str):
                raise TypeError
        except (TypeError, ValueError):
            raise ValueError(f"devices: {d!r} is neither an index into the visible GPUs "
                             "nor a GPU UUID") from None
        if not 0 <= i < len(visible):
            raise ValueError(f"devices: index {i} out of range: this process sees "
                             f"{len(visible)} GPU(s) ({','.join(visible) or 'none'})")
        out.append(visible[i])
    return out


def visible_devices(i, devices):
    """CUDA_VISIBLE_DEVICES of worker i: the list rotated to start at its
    own GPU (so device 0 in the worker is devices[i % len(devices)])."""
    k = i % len(devices)
    return ",".join(str(d) for d in devices[k:] + devices[:k])


def cuda_masks(n_workers, devices=None):
    """CUDA_VISIBLE_DEVICES of each of n_workers workers: the selected GPUs
    (select_devices(devices, parent_devices())) rotated, worker i first
    seeing the i-th (modulo their number). ValueError when none is left."""
    chosen = select_devices(devices, parent_devices())
    if not chosen:
        raise ValueError("backend 'cuda' but no GPU is visible")
    return [visible_devices(i, chosen) for i in range(n_workers)]


# Host memory of a worker process that is not dmem's pinned pool: the
# interpreter, the CUDA context, CuPy/Numba and the values Dask keeps itself.
PROCESS_RESERVE = 2 << 30
# The host burst of dmem.dask workers whose host limit is derived: the
# measured better trade on the Dask workloads (docs/dask.md, "Host memory").
DERIVED_HOST_BURST = 0.2


def default_host_limit(memory_limit, host_burst=None, host_staging=None):
    """The host tier limit (bytes) of a dmem worker whose process may use
    memory_limit bytes (the worker's, as distributed resolves it; None or 0:
    none, and then None: no host limit). host_staging: the runtime's option
    of that name (bytes, or a size string), when given and not 0, is the
    staging in the bound below (at least 64 MiB, as the runtime takes it).

    dmem's pinned pool grows, under sustained spilling, to the host tier's
    bound plus staging: ``H * (1 + host_burst) + min(H / 4, 1 GiB)``. Dask's
    memory manager starts evicting when the process's memory passes
    ``distributed.worker.memory.spill`` (0.7) of memory_limit (``target``
    when spill is off), one key at a time through ``evict()``. The derived H
    keeps that pool bound, plus PROCESS_RESERVE for the rest of the process,
    under the spill threshold, so that dmem's own push-down to disk (a
    stream of large sequential writes) moves what does not fit, and Dask's
    manager never has to."""
    if not memory_limit:
        return None
    import dask

    frac = dask.config.get("distributed.worker.memory.spill", 0.7)
    if not frac:
        frac = dask.config.get("distributed.worker.memory.target", 0.6) or 0.7
    burst = DERIVED_HOST_BURST if host_burst is None else float(host_burst)
    budget = frac * memory_limit - PROCESS_RESERVE
    if budget <= 0:
        return 64 << 20  # a worker with next to no memory: disk it is
    if host_staging:
        staging = (dask.utils.parse_bytes(host_staging) if isinstance(host_staging, str)
                   else int(host_staging))
        staging = max(64 << 20, staging)
        return max(64 << 20, int((budget - staging) / (1 + burst)))
    gib = float(1 << 30)
    h = (budget - gib) / (1 + burst)
    if h / 4 < gib:  # staging is a quarter of the limit below 4 GiB
        h = budget / (1.25 + burst)
    return max(64 << 20, int(h))


def derived_host_options(memory_limit, nthreads, host_memory_limit, host_burst,
                         host_staging=None):
    """(host_memory_limit, host_burst) for worker_options: those given, or
    when host_memory_limit is None, default_host_limit of the worker's
    memory_limit (as distributed's worker resolves it from memory_limit and
    nthreads; with the runtime's host_staging when given) with
    DERIVED_HOST_BURST unless a burst was given."""
    if host_memory_limit is not None:
        return host_memory_limit, host_burst
    import logging

    from distributed.worker_memory import parse_memory_limit

    try:
        m = parse_memory_limit(memory_limit, nthreads, logger=logging.getLogger("dmem.dask"))
    except (ValueError, TypeError):
        return None, host_burst  # distributed will say what is wrong with it
    h = default_host_limit(m, host_burst, host_staging)
    if h is None:
        return None, host_burst
    return h, DERIVED_HOST_BURST if host_burst is None else host_burst


def worker_options(backend, device_memory_limit=None, host_memory_limit=None, spill_dir=None,
                   host_target=None, ipc=None, host_burst=None, host_headroom=None,
                   **runtime_options):
    """The Worker/Nanny keyword arguments that make a dmem worker (the
    workers' DmemWorkerData applies DASK_HOST_HEADROOM when host_headroom
    is None and DMEM_HOST_HEADROOM is not set). runtime_options: keywords of
    dmem.Runtime in RUNTIME_OPTIONS, passed to each worker's runtime (None
    values left out)."""
    check_runtime_options(runtime_options, "worker_options()")
    data = {"backend": backend}
    if device_memory_limit is not None:
        data["device_memory_limit"] = device_memory_limit
    if host_memory_limit is not None:
        data["host_memory_limit"] = host_memory_limit
    if spill_dir is not None:
        data["spill_dir"] = os.fspath(spill_dir)
    if host_target is not None:
        data["host_target"] = host_target
    if host_burst is not None:
        data["host_burst"] = host_burst
    if host_headroom is not None:
        data["host_headroom"] = host_headroom
    data.update((k, v) for k, v in runtime_options.items() if v is not None)
    return {"data": (DmemWorkerData, data), "plugins": {DmemWorkerPlugin(ipc=ipc)}}


class LocalCluster(distributed.LocalCluster):
    """A local Dask cluster of dmem workers.

    Parameters
    ----------
    n_workers:
        Worker processes; default one per GPU (``devices``), or 2 on the host
        backend.
    device_memory_limit, host_memory_limit:
        Per worker: the device bytes of stored keys (as dask-cuda's
        device_memory_limit: a task's temporaries are not counted; the
        runtime's own limit stays the device's, DmemWorkerData) and dmem's
        pinned host limit (bytes or strings as Dask reads them: ``"8GB"``
        is 8e9 bytes, ``"8GiB"`` 2**33; ``"80%"`` of the device).
        host_memory_limit None: derived
        from the worker's ``memory_limit`` (default_host_limit: the pinned
        pool's bound under Dask's spill threshold), with host_burst 0.2;
        ``memory_limit=0`` (none): no host limit.
    host_burst:
        Per worker: how far past host_memory_limit the host tier may grow
        while it is pushed down to disk (DmemWorkerData's host_burst).
    host_headroom:
        Per worker: the most free pinned host memory the pinned pool keeps
        ahead of spills (bytes or a string as Dask reads it); None:
        ``DMEM_HOST_HEADROOM``, else 0 (DmemWorkerData's host_headroom: the
        pool grows only by what spills need; docs/dask.md, "Host memory").
    spill_dir:
        Parent folder of the workers' disk tiers (default: each worker's
        local directory).
    backend:
        ``"cuda"``, ``"host"`` or None (CUDA when a GPU is found).
    devices:
        Which of this process's GPUs to use: indices into the list that
        ``CUDA_VISIBLE_DEVICES`` gives (``devices=[1]`` with
        ``CUDA_VISIBLE_DEVICES=2,3`` is physical GPU 3), or GPU UUIDs;
        default: every visible GPU, in that order.
    ipc:
        Send device arrays between the workers by CUDA IPC
        (dmem.dask.ipc; None: the workers' ``DMEM_DASK_IPC``, default on).
    **kwargs:
        The other keywords of dmem.Runtime (dmem.dask.RUNTIME_OPTIONS:
        ``eviction_policy``, ``host_reserve``, ``log_level``, ...), given to
        each worker's runtime as they are; and distributed.LocalCluster's
        (``threads_per_worker``, ``memory_limit``, ``dashboard_address``,
        ...). ``processes`` must stay True and ``worker_class`` is Nanny.
    """

    def __init__(self, n_workers=None, device_memory_limit=None, host_memory_limit=None,
                 spill_dir=None, *, backend=None, devices=None, host_target=None, ipc=None,
                 host_burst=None, host_headroom=None, **kwargs):
        if kwargs.get("processes") is False:
            raise ValueError("dmem.dask.LocalCluster runs one worker process per GPU: "
                             "processes=False is not supported")
        if "data" in kwargs or "worker_class" in kwargs:
            raise ValueError("dmem.dask.LocalCluster sets data= and worker_class= itself")
        if backend not in (None, "cuda", "host"):
            raise ValueError(f"backend must be 'cuda', 'host' or None, not {backend!r}")
        if n_workers is not None and (not isinstance(n_workers, int) or n_workers < 0):
            raise ValueError(f"n_workers must be a non-negative int, not {n_workers!r}")
        if backend is None:
            backend = "cuda" if gpu_count() > 0 else "host"
        if backend == "cuda":
            devices = select_devices(devices, parent_devices())
            if not devices:
                raise ValueError("backend 'cuda' but no GPU is visible")
            if n_workers is None:
                n_workers = len(devices)
            kwargs.setdefault("threads_per_worker", 1)
        else:
            devices = []
            if n_workers is None:
                n_workers = 2
        self._devices = devices
        self._n_requested = n_workers
        host_memory_limit, host_burst = derived_host_options(
            kwargs.get("memory_limit", "auto"), kwargs.get("threads_per_worker") or 1,
            host_memory_limit, host_burst, kwargs.get("host_staging"))
        self.host_memory_limit = host_memory_limit
        runtime_options = {k: kwargs.pop(k) for k in RUNTIME_OPTIONS if k in kwargs}
        options = worker_options(backend, device_memory_limit, host_memory_limit, spill_dir,
                                 host_target, ipc, host_burst, host_headroom, **runtime_options)
        plugins = set(kwargs.pop("plugins", ())) | options["plugins"]
        super().__init__(n_workers=0, processes=True, worker_class=Nanny, data=options["data"],
                         plugins=plugins, **kwargs)
        self.backend = backend
        self.scale(n_workers)
        if not self.asynchronous:
            self.sync(self._correct_state)

    def new_worker_spec(self):
        spec = super().new_worker_spec()
        if not self._devices:
            return spec
        ((name, template),) = spec.items()
        template = copy.deepcopy(template)
        env = dict(template["options"].get("env") or {})
        i = name if isinstance(name, int) else len(self.worker_spec)
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(i, self._devices)
        template["options"]["env"] = env
        return {name: template}
