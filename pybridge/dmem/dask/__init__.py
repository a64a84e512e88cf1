"""dmem.dask: Dask drives dmem's spilling.

    from dmem.dask import LocalCluster
    from distributed import Client
    client = Client(LocalCluster(device_memory_limit="8GB"))

- :class:`DmemWorkerData`: a worker's ``data=`` mapping. Device arrays (CuPy,
  Numba; NumPy on the host backend) are kept in dmem spillable buffers and
  spilled in place (device -> pinned host -> disk), least recently used keys
  first; other values go to distributed's SpillBuffer. It follows
  distributed's ManualEvictProto (``fast``, ``evict()``).
- :class:`DmemWorkerPlugin`: ready tasks' inputs count as hot, values sent to
  other workers are read where they are, dmem's bytes in the heartbeat.
- :class:`LocalCluster`: one dmem worker process per GPU.
- ``python -m dmem.dask.worker SCHEDULER``: the same on a node of a
  multi-machine cluster.

Needs ``dask`` and ``distributed``; importing dmem.dask without them raises
ImportError naming them. docs/dask.md has the details.
"""

try:
    import dask  # noqa: F401
    import distributed  # noqa: F401
except ImportError as e:  # pragma: no cover - CI installs them
    raise ImportError(f"dmem.dask needs the 'dask' and 'distributed' packages: {e}") from e

from . import serialize  # noqa: F401  (registers the serializers)
from .cluster import LocalCluster
from .data import DmemValue, DmemWorkerData
from .plugin import DmemWorkerPlugin

__all__ = ["DmemValue", "DmemWorkerData", "DmemWorkerPlugin", "LocalCluster"]
