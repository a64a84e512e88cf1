"""Serialisation of stored device values between processes.

A worker answering ``get_data`` hands out :class:`~dmem.dask.data.DmemValue`
objects (dmem.dask.plugin). Their serializers send each array's bytes from
the tier they are in (``Buffer.peek``: device, pinned host or disk), without
unspilling them. The receiver rebuilds plain arrays: CuPy (or Numba) arrays
for device values when it has a GPU, NumPy arrays otherwise. A receiving
dmem worker then keeps them in a buffer of its own runtime (adopted without a
copy when they were allocated through ``dmem.cupy``).

Families: "dask" (host frames: TCP) and "cuda" (UCX: a resident array goes
as a device frame that keeps its buffer locked until it is sent; a spilled
one as a host frame). Pickle works too (DmemValue.__reduce__). In the "dask"
family, a device array sent to another worker of the same machine goes as
a CUDA IPC handle instead of bytes (dmem.dask.ipc), when the value's
Transfer allows it; the header's "ipc" list then says which leaves.
"""

import collections
import time

from distributed.protocol import pickle
from distributed.protocol.cuda import cuda_deserialize, cuda_serialize
from distributed.protocol.serialize import dask_deserialize, dask_serialize

from .. import arrays as _arrays
from . import ipc
from .data import DmemValue

__all__ = ["calls", "timing"]

# Per process: how many values each family serialised (tests count them).
calls = collections.Counter()
# Per process: seconds spent serializing ("serialize_s") and deserializing
# ("deserialize_s") values, and the tier each sent leaf was read from
# ("from_resident", "from_deferred_host", "from_deferred_disk", ...), and
# the CUDA IPC counters of dmem.dask.ipc ("ipc_sent", "ipc_received", ...).
timing = collections.Counter()


def _header(value):
    leaves = _arrays.leaves_of(value.tree)
    return leaves, {
        "skeleton": pickle.dumps(_arrays.skeleton(value.tree)),
        "device": value.device,
        "nbytes": [leaf.nbytes for leaf in leaves],
    }


@dask_serialize.register(DmemValue)
def _dask_serialize(value):
    t0 = time.perf_counter()
    calls["dask"] += 1
    leaves, header = _header(value)
    _count_tiers(leaves)
    transfer = value.transfer
    use_ipc = transfer is not None and transfer.ipc and value.device
    entries = [ipc.export(leaf, transfer, timing) if use_ipc else None for leaf in leaves]
    frames = [memoryview(b"") if e is not None else memoryview(_arrays.peek(leaf))
              for leaf, e in zip(leaves, entries)]
    if any(e is not None for e in entries):
        header["ipc"] = entries
    timing["serialize_s"] += time.perf_counter() - t0
    return header, frames


@dask_deserialize.register(DmemValue)
def _dask_deserialize(header, frames):
    t0 = time.perf_counter()
    value = _rebuild(header, frames)
    timing["deserialize_s"] += time.perf_counter() - t0
    return value


def _count_tiers(leaves):
    for leaf in leaves:
        timing["from_" + leaf.buf.state] += 1


@cuda_serialize.register(DmemValue)
def _cuda_serialize(value):
    calls["cuda"] += 1
    leaves, header = _header(value)
    _count_tiers(leaves)
    frames = []
    for leaf in leaves:
        if leaf.kind != "numpy" and leaf.buf.state == "resident":
            raw = _arrays.expose(leaf)  # locked until the frame is sent
            frames.append(raw.ravel(order="K").view("u1"))
        else:
            frames.append(memoryview(_arrays.peek(leaf)))
    return header, frames


@cuda_deserialize.register(DmemValue)
def _cuda_deserialize(header, frames):
    return _rebuild(header, frames)


def _rebuild(header, frames):
    frames = list(frames)
    entries = header.get("ipc")
    if entries:  # device to device from the sender's GPU (needs one here)
        frames = [ipc.fetch(e, timing) if e is not None else f for e, f in zip(entries, frames)]
        device = True
    else:
        device = header["device"] and _have_gpu()
    return _arrays.rebuild(pickle.loads(header["skeleton"]), frames, device)


def _have_gpu():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False
