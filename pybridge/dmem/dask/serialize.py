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
one as a host frame). Pickle works too (DmemValue.__reduce__).

To another worker of the same host (the comm's two addresses name one host;
a client or the scheduler, which may forward the message unread, always
gets the bytes), the "dask" family does not push them through the socket: the
sender reads them into an anonymous shared-memory file (``memfd_create``)
and sends its process id, descriptor number and a random token; the
receiver maps ``/proc/PID/fd/FD``, checks the token and copies the arrays
out. The file lives as long as the DmemValue, which ``Worker.get_data``
holds until the receiver has acknowledged the message (distributed's
two-step handshake), and being anonymous it is gone with the sender, even
after ``kill -9``. ``DMEM_DASK_SHM=0`` turns this off (then every byte goes
through the socket).
"""

import collections
import mmap
import os
import secrets
import time
import weakref

from distributed.protocol import pickle
from distributed.protocol.cuda import cuda_deserialize, cuda_serialize
from distributed.protocol.serialize import dask_deserialize, dask_serialize

from . import _arrays
from .data import DmemValue

__all__ = ["calls", "shared", "timing"]

# Per process: how many values each family serialised (tests count them).
calls = collections.Counter()
# Per process: values sent ("sent") and received ("received") through a
# shared-memory file instead of the socket.
shared = collections.Counter()

# Per process: seconds spent serializing ("serialize_s") and deserializing
# ("deserialize_s") values, and the tier each sent leaf was read from
# ("from_resident", "from_deferred_host", "from_deferred_disk", ...).
timing = collections.Counter()

_TOKEN = 16  # bytes of random token at the start of a shared-memory file


def _header(value):
    leaves = _arrays.leaves_of(value.tree)
    return leaves, {
        "skeleton": pickle.dumps(_arrays.skeleton(value.tree)),
        "device": value.device,
        "nbytes": [leaf.nbytes for leaf in leaves],
    }


@dask_serialize.register(DmemValue)
def _dask_serialize(value, context=None):
    t0 = time.perf_counter()
    calls["dask"] += 1
    leaves, header = _header(value)
    for leaf in leaves:
        if leaf.kind != "numpy":
            timing["from_" + leaf.buf.state] += 1
    if value.to_worker and _same_host(context) and sum(header["nbytes"]):
        header["shm"] = _to_shared_file(value, leaves, header["nbytes"])
        shared["sent"] += 1
        frames = []
    else:
        frames = [memoryview(_arrays.peek(leaf)) for leaf in leaves]
    timing["serialize_s"] += time.perf_counter() - t0
    return header, frames


@dask_deserialize.register(DmemValue)
def _dask_deserialize(header, frames):
    t0 = time.perf_counter()
    if "shm" in header:
        frames = _from_shared_file(header["shm"], header["nbytes"])
        shared["received"] += 1
    value = _rebuild(header, frames)
    timing["deserialize_s"] += time.perf_counter() - t0
    return value


def _host_of(address):
    """'tcp://10.0.0.5:8786' -> '10.0.0.5'; None when there is no host."""
    if not isinstance(address, str) or "://" not in address:
        return None
    rest = address.split("://", 1)[1]
    if rest.startswith("["):  # IPv6
        return rest[1:].split("]", 1)[0]
    return rest.rsplit(":", 1)[0] if ":" in rest else rest


def _same_host(context):
    """True when the comm's two ends are processes of this host (same
    address, network namespace included) and shared files are allowed."""
    if os.environ.get("DMEM_DASK_SHM", "1") == "0" or not hasattr(os, "memfd_create"):
        return False
    if not context:
        return False
    ends = [_host_of((context.get(k) or {}).get("address")) for k in ("sender", "recipient")]
    return ends[0] is not None and ends[0] == ends[1]


def _to_shared_file(value, leaves, nbytes):
    """The leaves' bytes, read where they are (no unspill), into an
    anonymous file that stays open as long as `value`."""
    token = secrets.token_bytes(_TOKEN)
    fd = os.memfd_create("dmem-dask-transfer", os.MFD_CLOEXEC)
    try:
        total = _TOKEN + sum(nbytes)
        os.ftruncate(fd, total)
        with mmap.mmap(fd, total) as mm:
            mm[:_TOKEN] = token
            view = memoryview(mm)
            try:
                pos = _TOKEN
                for leaf, n in zip(leaves, nbytes):
                    if n:
                        leaf.buf.readinto(view[pos:pos + n], leaf.offset)
                    pos += n
            finally:
                view.release()
    except BaseException:
        os.close(fd)
        raise
    weakref.finalize(value, os.close, fd)  # after the receiver's "OK"
    return {"pid": os.getpid(), "fd": fd, "size": total, "token": token}


def _from_shared_file(ref, nbytes):
    """Frames (memoryviews of a private read-only mapping) of the sender's
    shared file; they keep the mapping alive as long as they are used."""
    path = f"/proc/{int(ref['pid'])}/fd/{int(ref['fd'])}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise RuntimeError(
            f"dmem.dask: cannot open the sender's shared-memory file {path} ({e}); "
            "set DMEM_DASK_SHM=0 where workers share an address but not their /proc") from e
    try:
        if os.fstat(fd).st_size != ref["size"]:
            raise RuntimeError(f"dmem.dask: {path} is not the file the sender named")
        mm = mmap.mmap(fd, ref["size"], access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    view = memoryview(mm)
    if bytes(view[:_TOKEN]) != ref["token"]:
        view.release()
        mm.close()
        raise RuntimeError(f"dmem.dask: {path} is not the file the sender named")
    frames, pos = [], _TOKEN
    for n in nbytes:
        frames.append(view[pos:pos + n])
        pos += n
    return frames


@cuda_serialize.register(DmemValue)
def _cuda_serialize(value):
    calls["cuda"] += 1
    leaves, header = _header(value)
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
    device = header["device"] and _have_gpu()
    return _arrays.rebuild(pickle.loads(header["skeleton"]), list(frames), device)


def _have_gpu():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False
