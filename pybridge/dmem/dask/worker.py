"""python -m dmem.dask.worker SCHEDULER_ADDRESS [options]

Starts, on this node, one Nanny-managed dmem worker per GPU (each seeing its
own GPU first), or ``--n-workers`` workers on dmem's host backend when the
node has no GPU, connected to a scheduler that runs elsewhere
(``dask scheduler``). Runs until interrupted (SIGINT/SIGTERM) or until the
workers are closed from the scheduler.
"""

import argparse
import asyncio
import signal
import sys

__all__ = ["main"]


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m dmem.dask.worker",
        description="Start dmem-backed Dask workers (one per GPU) for a remote scheduler.")
    p.add_argument("scheduler", help="scheduler address, e.g. tcp://10.0.0.1:8786")
    p.add_argument("--device-memory-limit", default=None,
                   help="device bytes of stored keys per worker, as dask-cuda's "
                        "(bytes, '8GB', '80%%')")
    p.add_argument("--host-memory-limit", default=None,
                   help="dmem pinned host limit per worker (bytes, '32GB'; default: derived "
                        "from --memory-limit, see docs/dask.md)")
    p.add_argument("--host-burst", type=float, default=None,
                   help="how far past the host limit (a fraction of it, 0 to 1) the host tier "
                        "may grow while it is pushed down to disk (default 0.2 with a derived "
                        "host limit, else 0.5)")
    p.add_argument("--host-headroom", default=None,
                   help="the most free pinned host memory the pinned pool keeps ahead of "
                        "spills (bytes, '256MiB'; default: DMEM_HOST_HEADROOM, else 0: the "
                        "pool grows only by what spills need, see docs/dask.md)")
    p.add_argument("--spill-dir", default=None, help="parent folder of the disk tiers")
    p.add_argument("--nthreads", type=int, default=1, help="threads per worker (default 1)")
    p.add_argument("--memory-limit", default="auto",
                   help="Dask's process memory limit per worker (default 'auto')")
    p.add_argument("--n-workers", type=int, default=None,
                   help="workers (default: one per GPU; 1 on the host backend)")
    p.add_argument("--backend", choices=("cuda", "host"), default=None,
                   help="default: cuda when a GPU is visible, else host")
    p.add_argument("--devices", default=None,
                   help="which of the GPUs this process sees, as indices into its "
                        "CUDA_VISIBLE_DEVICES (or GPU UUIDs), e.g. 0,1 (default: all, in order)")
    p.add_argument("--name", default=None, help="worker name prefix (default: the host name)")
    p.add_argument("--local-directory", default=None, help="workers' local directory")
    p.add_argument("--host", default=None, help="interface address the workers listen on")
    p.add_argument("--no-ipc", dest="ipc", action="store_false", default=None,
                   help="send device arrays between this node's workers as bytes, not by "
                        "CUDA IPC (default: the DMEM_DASK_IPC environment variable, else IPC)")
    p.add_argument("--dashboard-address", default=None,
                   help="worker dashboard address (default: none)")
    _add_runtime_options(p)
    return p


def _log_level(text):
    return int(text) if text.isdigit() else text


def _add_runtime_options(p):
    """--eviction-policy, --host-reserve, ...: one per keyword of dmem.Runtime
    that dmem.dask passes through (RUNTIME_OPTIONS, from the C library's table
    of options), given to each worker's runtime as it is."""
    import dmem

    from .data import RUNTIME_OPTIONS

    rows = {o["keyword"]: o for o in dmem._dmem._config_options() if o["keyword"]}
    for kw in RUNTIME_OPTIONS:
        o = rows[kw]
        extra = {}
        if o["kind"] == "fraction":
            extra["type"] = float
        elif o["kind"] == "integer":
            extra["type"] = int
        elif o["kind"] == "log":
            extra["type"] = _log_level
        elif o["kind"] == "choice":
            extra["choices"] = [c for c in o["choices"].split("|") if c]
        p.add_argument("--" + kw.replace("_", "-"), dest="rt_" + kw, default=None,
                       help=f"the workers' runtimes' {o['doc']} (dmem.Runtime's {kw}; "
                            f"default: {o['env']} or dmem's default)", **extra)


def _plan(args):
    """(backend, [(name, env)]) for the workers to start."""
    from .cluster import cuda_masks, gpu_count

    backend = args.backend
    if backend is None:
        backend = "cuda" if gpu_count() > 0 else "host"
    if args.n_workers is not None and args.n_workers < 1:
        raise SystemExit("--n-workers must be at least 1")
    if args.nthreads < 1:
        raise SystemExit("--nthreads must be at least 1")
    prefix = args.name
    if prefix is None:
        import socket

        prefix = socket.gethostname()
    if backend == "cuda":
        try:
            n_gpus = len(cuda_masks(1, args.devices)[0].split(","))
            n = args.n_workers if args.n_workers is not None else n_gpus
            masks = cuda_masks(n, args.devices)
        except ValueError as e:
            raise SystemExit(f"--devices: {e}") from None
        return backend, [(f"{prefix}-{i}", {"CUDA_VISIBLE_DEVICES": m})
                         for i, m in enumerate(masks)]
    n = args.n_workers if args.n_workers is not None else 1
    return backend, [(f"{prefix}-{i}", {}) for i in range(n)]


async def _run(args):
    from distributed import Nanny

    from .cluster import derived_host_options, worker_options

    backend, plan = _plan(args)
    host_limit, host_burst = derived_host_options(args.memory_limit, args.nthreads,
                                                  args.host_memory_limit, args.host_burst,
                                                  getattr(args, "rt_host_staging", None))
    runtime_options = {k[3:]: v for k, v in vars(args).items() if k.startswith("rt_")}
    opts = worker_options(backend, args.device_memory_limit, host_limit,
                          args.spill_dir, ipc=args.ipc, host_burst=host_burst,
                          host_headroom=args.host_headroom, **runtime_options)
    extra = {}
    if args.local_directory is not None:
        extra["local_directory"] = args.local_directory
    if args.host is not None:
        extra["host"] = args.host
    if args.dashboard_address is not None:
        extra["dashboard_address"] = args.dashboard_address
        extra["dashboard"] = True
    nannies = [
        Nanny(args.scheduler, nthreads=args.nthreads, memory_limit=args.memory_limit, name=name,
              env=env, **opts, **extra)
        for name, env in plan
    ]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    await asyncio.gather(*nannies)
    print(f"dmem.dask.worker: {len(nannies)} {backend} worker(s) connected to {args.scheduler}",
          flush=True)
    finished = asyncio.ensure_future(asyncio.gather(*(n.finished() for n in nannies)))
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([finished, stopped], return_when=asyncio.FIRST_COMPLETED)
    await asyncio.gather(*(n.close(timeout=10) for n in nannies), return_exceptions=True)
    finished.cancel()
    stopped.cancel()


def main(argv=None):
    args = _parser().parse_args(argv)
    asyncio.run(_run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
