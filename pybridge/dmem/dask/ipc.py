"""CUDA IPC between dmem workers on one machine.

Over TCP, distributed sends a device array as host frames: a device-to-host
copy into fresh pageable memory on the sender, the socket (about 1 GB/s per
worker on the lent H200s), a host-to-device copy on the receiver. Between two
dmem workers of the same machine, a device array can go device to device
instead:

- The sender (``export``) locks the array's buffer, so that it can be
  neither spilled nor freed, and sends the CUDA IPC handle of the pool slab
  that holds it with the array's offset in that slab (``Runtime.ipc_handle``:
  dmem's device memory is ``cudaMalloc`` slabs, which CUDA IPC shares).
- The receiver (``fetch``) opens the handle (``cudaIpcOpenMemHandle`` with
  lazy peer access), copies the bytes into a new array on its own GPU (over
  NVLink or PCIe peer to peer), waits for the copy and closes the handle,
  all while it deserializes the message.
- distributed's ``get_data`` answers in two steps: the sender keeps the
  message until the receiver has read *and deserialized* it and replied
  "OK". The plugin's ``get_data`` wrapper (dmem.dask.plugin) drops the
  sender's locks only then (``Transfer.release``), so the bytes stay where
  the handle says for as long as the receiver reads them.

A spilled array is locked too, which brings its bytes back to the sender's
device first: a pinned host-to-device copy plus a device-to-device one beat
the socket by an order of magnitude, and the transposes of a dask.array
graph send mostly arrays that the sender itself no longer needs (spilled
first, as cold keys).

IPC is used only when all of these hold (``Transfer.for_call``): the
runtime is on CUDA, the request comes from another worker (``who``: clients
and the scheduler always get bytes), over TCP or TLS between two addresses
of the same host, the plugin's ``ipc`` option is on (the
``DMEM_DASK_IPC`` environment variable, default 1), and the sender's GPU can
reach every GPU it sees peer to peer (``peers_reachable``). Otherwise arrays are sent
as bytes, from the tier they are in, without unspilling them. The
receiving process must see the sender's GPU (``dmem.dask.LocalCluster``
rotates ``CUDA_VISIBLE_DEVICES`` so that every worker sees all of them);
where it cannot open the handle, ``fetch`` raises RuntimeError naming the
option that turns IPC off.
"""

import os
import threading
import time

import dmem

from .. import arrays as _arrays

__all__ = ["Transfer", "enabled_by_default", "export", "fetch", "peers_reachable", "same_host"]

# Counters of this process, kept in dmem.dask.serialize.timing:
# "ipc_sent" / "ipc_sent_bytes" (leaves exported), "ipc_received" /
# "ipc_received_bytes" / "ipc_s" (leaves fetched and the seconds it took,
# of which "ipc_alloc_s" allocating their device memory),
# "ipc_unexported" (device leaves sent as bytes after all).


def enabled_by_default():
    """The plugin's default for ``ipc``: DMEM_DASK_IPC (1, the default, or 0)."""
    v = os.environ.get("DMEM_DASK_IPC", "1").strip().lower()
    if v in ("1", "true", "yes", "on", ""):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"DMEM_DASK_IPC must be 0 or 1, not {v!r}")


def _host(address):
    from distributed.comm.addressing import get_address_host, parse_address

    scheme, _ = parse_address(address)
    if scheme not in ("tcp", "tls"):
        return None
    return get_address_host(address)


def same_host(comm, who):
    """Whether a get_data call on ``comm`` from ``who`` comes from another
    worker on this machine: ``who`` (the asking worker's address; None for
    clients and the scheduler) and both ends of the TCP/TLS connection name
    one host."""
    if who is None or comm is None:
        return False
    try:
        local = _host(comm.local_address)
        peer = _host(comm.peer_address)
        asker = _host(who)
    except (ValueError, TypeError, AttributeError):
        return False
    return local is not None and local == peer == asker


_peers = None


def peers_reachable():
    """Whether this process's GPU (device 0) can reach every other GPU it
    sees peer to peer, which opening a handle of another GPU needs (checked
    once per process; False without CuPy or a device)."""
    global _peers
    if _peers is None:
        try:
            import cupy

            rt = cupy.cuda.runtime
            n = rt.getDeviceCount()
            _peers = n > 0 and all(rt.deviceCanAccessPeer(0, d) for d in range(1, n))
        except Exception:
            _peers = False
    return _peers


class Transfer:
    """One get_data answer: whether its device arrays may go by IPC, and the
    arrays it keeps locked until the receiver has acknowledged them."""

    __slots__ = ("ipc", "_holds", "_lock")

    def __init__(self, ipc=False):
        self.ipc = bool(ipc)
        self._holds = []
        self._lock = threading.Lock()

    @classmethod
    def for_call(cls, runtime, enabled, comm, who):
        return cls(enabled and runtime.backend == "cuda" and same_host(comm, who)
                   and peers_reachable())

    def hold(self, array):
        with self._lock:
            self._holds.append(array)

    @property
    def held(self):
        with self._lock:
            return len(self._holds)

    def release(self):
        """Drop the locks: the receiver is done with the handles."""
        with self._lock:
            holds, self._holds = self._holds, []
        del holds


# The last reason a leaf could not be exported (sent as bytes instead).
last_error = None


def export(leaf, transfer, timing):
    """[handle, offset, pid, nbytes] of a device leaf, locked (held by
    transfer) until transfer.release(); a spilled leaf is brought back to
    the device first (from pinned host memory at PCIe speed: far faster than
    its bytes over a socket). None when the leaf is a host array, or it
    cannot be locked or has no IPC handle (it is then sent as bytes, from
    where it is; ``last_error`` says why)."""
    global last_error
    if leaf.kind == "numpy":
        return None
    try:
        array = _arrays.expose(leaf)  # locked; the lock's stream is synchronised
        ptr = array.__cuda_array_interface__["data"][0]
        handle, offset = leaf.buf.runtime.ipc_handle(ptr)
    except (dmem.DmemError, MemoryError) as e:  # no room, no slab, or the driver refused
        last_error = e
        timing["ipc_unexported"] += 1
        return None
    transfer.hold(array)
    timing["ipc_sent"] += 1
    timing["ipc_sent_bytes"] += leaf.nbytes
    return [handle, offset, os.getpid(), leaf.nbytes]


def fetch(entry, timing):
    """A new CuPy uint8 array on this process's current GPU holding the bytes
    that ``export`` described in entry, copied device to device."""
    import cupy

    handle, offset, pid, nbytes = entry
    if pid == os.getpid():
        raise RuntimeError("dmem.dask: a CUDA IPC handle came back to the process that made it")
    t0 = time.perf_counter()
    rt = cupy.cuda.runtime
    dst = cupy.empty(nbytes, dtype=cupy.uint8)  # dmem.cupy's allocator on a dmem worker
    stream = cupy.cuda.get_current_stream()  # the one dst was allocated on
    t1 = time.perf_counter()
    timing["ipc_alloc_s"] += t1 - t0  # making room for it, when the device is full
    try:
        base = rt.ipcOpenMemHandle(bytes(handle), rt.cudaIpcMemLazyEnablePeerAccess)
    except Exception as e:
        raise RuntimeError(
            f"dmem.dask: cannot open the CUDA IPC handle sent by process {pid} ({e}); this "
            "process must see the sender's GPU (CUDA_VISIBLE_DEVICES), or set "
            "DMEM_DASK_IPC=0 on the workers (DmemWorkerPlugin(ipc=False)) to send bytes") from e
    try:
        rt.memcpyAsync(dst.data.ptr, base + offset, nbytes, getattr(rt, "memcpyDefault", 4),
                       stream.ptr)
        stream.synchronize()  # before the handle closes and the sender unlocks
    finally:
        rt.ipcCloseMemHandle(base)
    timing["ipc_received"] += 1
    timing["ipc_received_bytes"] += nbytes
    timing["ipc_s"] += time.perf_counter() - t0
    return dst
