"""dmem.dask.DmemWorkerData: the ``data=`` mapping of a distributed Worker.

Task results that are device arrays (CuPy or Numba arrays; NumPy arrays on
the host backend), alone or in tuples, lists and dicts, are kept in dmem
spillable buffers; everything else goes to a distributed ``SpillBuffer``, as a
plain worker keeps it. See docs/dask.md for how keys, exposure and tiers map
to one another.

Threading: the worker calls the mapping from its event loop; dmem calls
(allocation, locking, spilling) are made without the mapping's lock held, so
a controller callback (on any thread) never waits for it.
"""

import collections
import contextvars
import logging
import os
import sys
import threading
import weakref
from collections.abc import MutableMapping

import dmem

from .. import arrays as _arrays
from .ipc import Transfer

__all__ = ["DmemWorkerData", "DmemValue", "RUNTIME_OPTIONS"]

logger = logging.getLogger("dmem.dask")

# Set while the worker answers get_data (dmem.dask.plugin): __getitem__ then
# gives a DmemValue, whose serializers read the bytes where they are. The
# value is that answer's dmem.dask.ipc.Transfer (or True: bytes only).
for_transfer = contextvars.ContextVar("dmem_dask_for_transfer", default=False)

# The mapping of this process (the last one made), for statistics and tests.
_current = None

# Buffer priority of a cold key: one that no task on this worker still needs
# (every dependent here has run). dmem spills and pushes down to disk lowest
# priority first, so cold keys leave the device and the host tier before keys
# whose dependents are still to run, whatever their last use.
COLD = -1

# Task states of a dependent that has yet to run on this worker.
_PENDING = frozenset(("waiting", "ready", "executing", "constrained", "long-running", "resumed"))


def current():
    """The DmemWorkerData of this process, or None."""
    return _current() if _current is not None else None


class DmemValue:
    """A stored device value on its way to another process: serializing it
    reads each array's bytes from the tier it is in, without unspilling.

    One handed out by the mapping (``get_data``) keeps the key's buffers
    alive for as long as it lives, whatever happens to the key meanwhile:
    when the scheduler releases the key while the message is still being
    written (distributed serialises large messages off the event loop), the
    buffers are freed only once the value is gone, that is once the message
    is written and, for CUDA IPC, the receiver has answered."""

    __slots__ = ("tree", "device", "transfer", "__weakref__")

    def __init__(self, tree, device, transfer=None):
        self.tree = tree
        self.device = device  # rebuild as device arrays on the receiver
        # the get_data answer it belongs to (dmem.dask.ipc.Transfer), or None
        self.transfer = transfer

    def __reduce__(self):
        frames = [_arrays.peek(leaf) for leaf in _arrays.leaves_of(self.tree)]
        return (_arrays.rebuild, (_arrays.skeleton(self.tree), frames, self.device))

    def __sizeof__(self):
        return object.__sizeof__(self) + sum(leaf.nbytes for leaf in _arrays.leaves_of(self.tree))


class _Entry:
    """One device key's buffers. ``pins``: DmemValues handed out for
    transfers and still alive; ``released``: the key is gone from the
    mapping, the buffers go when the last pin does. Both under the
    mapping's lock."""

    __slots__ = ("tree", "leaves", "nbytes", "pins", "released")

    def __init__(self, tree, leaves):
        self.tree = tree
        self.leaves = leaves
        self.nbytes = sum(leaf.nbytes for leaf in leaves)
        self.pins = 0
        self.released = False


def _free_entry(entry):
    for leaf in entry.leaves:
        _arrays.discard(leaf)  # an exposed buffer goes when its arrays do


def _release(lock, entry):
    """The key of entry leaves the mapping: free its buffers now, or when
    the last DmemValue holding them goes."""
    with lock:
        entry.released = True
        free = entry.pins == 0
    if free:
        _free_entry(entry)


def _unpin(lock, entry):
    """A DmemValue of entry was collected (weakref.finalize: any thread)."""
    with lock:
        entry.pins -= 1
        free = entry.pins == 0 and entry.released
    if free:
        _free_entry(entry)


class _Victims(dmem.Controller):
    """Chooses the runtime's spill victims by task key: least recently used
    keys first, keys that ready or executing tasks need last."""

    def __init__(self, data):
        self._data = weakref.ref(data)

    def select_victims(self, nbytes):
        data = self._data()
        if data is None:
            return None
        return data._victims(nbytes)


def parse_size(value, what="size"):
    """A size of dmem.dask as Dask reads it: None; an int (bytes); a string
    read by dask.utils.parse_bytes ("8GB" = 8e9 bytes, "8GiB" = 2**33, "8G"
    = 8e9, as Dask and dask-cuda mean them), or "N%" (a share of the device,
    left to dmem). Raises TypeError for other types, ValueError for a string
    Dask cannot read or a negative size."""
    from dask.utils import parse_bytes

    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{what} must be bytes (int) or a string such as '8GB', "
                        f"not {type(value).__name__}")
    if isinstance(value, str):
        if value.strip().endswith("%"):
            return value.strip()
        try:
            value = parse_bytes(value)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
    if value < 0:
        raise ValueError(f"{what} must not be negative, not {value}")
    return int(value)


# The keywords of dmem.Runtime that dmem.dask names itself (device_memory_limit
# for device_limit, ...) or derives (host_burst, host_headroom).
_OWN_OPTIONS = {"backend", "device", "device_limit", "host_limit", "spill_dir", "host_capacity",
                "host_burst", "host_headroom"}
# The other keywords of dmem.Runtime, passed through as they are to each
# worker's runtime by DmemWorkerData, LocalCluster and the worker CLI: the
# rows of the C library's table of options (DMEM_CONFIG_OPTIONS) that have a
# Python keyword, so that a new option reaches Dask with no code here.
RUNTIME_OPTIONS = tuple(o["keyword"] for o in dmem._dmem._config_options()
                        if o["keyword"] and o["keyword"] not in _OWN_OPTIONS)


def check_runtime_options(options, where):
    """TypeError for a key of options that is not in RUNTIME_OPTIONS."""
    for k in options:
        if k not in RUNTIME_OPTIONS:
            raise TypeError(f"{where} got an unexpected keyword argument {k!r}")


# The pinned pool's headroom (dmem.Runtime's host_headroom) of dmem.dask
# workers when neither host_headroom nor DMEM_HOST_HEADROOM gives one: none,
# the pool grows only by what spills need (docs/dask.md, "Host memory").
DASK_HOST_HEADROOM = 0


def _runtime_for(backend, device, device_memory_limit, host_memory_limit, spill_dir,
                 host_burst=None, host_headroom=None, options=None):
    """(runtime, owned): the process's default runtime, configured with these
    limits when it does not exist yet; a private runtime when it already does
    and limits or options (RUNTIME_OPTIONS, None values left out) were asked
    for. host_headroom None: DMEM_HOST_HEADROOM, else DASK_HOST_HEADROOM
    (which alone does not make a private runtime)."""
    options = {k: v for k, v in (options or {}).items() if v is not None}
    device_memory_limit = parse_size(device_memory_limit, "device_memory_limit")
    host_memory_limit = parse_size(host_memory_limit, "host_memory_limit")
    host_headroom = parse_size(host_headroom, "host_headroom")
    if isinstance(host_headroom, str):  # "N%": dmem.Runtime says what is wrong
        raise ValueError(f"host_headroom must be a size, not {host_headroom!r}")
    headroom_given = host_headroom is not None
    if not headroom_given and not os.environ.get("DMEM_HOST_HEADROOM"):
        host_headroom = DASK_HOST_HEADROOM
    kw = {}
    if backend is not None:
        kw["backend"] = backend
    if device is not None:
        kw["device"] = device
    # device_memory_limit is the stored keys' target (DmemWorkerData keeps
    # them under it, as dask-cuda does), not a hard limit on every byte: on
    # a GPU the runtime's limit stays the device's (DMEM_DEVICE_LIMIT or the
    # card), so that a task's temporaries and output in flight do not push
    # stored keys out. The host backend's "device" is the limit itself.
    if device_memory_limit is not None and backend == "host":
        kw["device_limit"] = device_memory_limit
    if host_memory_limit is not None:
        kw["host_limit"] = host_memory_limit
    if spill_dir is not None:
        kw["spill_dir"] = spill_dir
    if host_burst is not None:
        kw["host_burst"] = host_burst
    if host_headroom is not None:
        kw["host_headroom"] = host_headroom
    if backend == "host" and isinstance(device_memory_limit, int):
        kw["host_capacity"] = device_memory_limit
    kw.update(options)
    try:
        dmem.configure(**kw)
    except dmem.BusyError:
        # the default runtime exists already (another mapping of this
        # process, or an allocator hook used first)
        if device_memory_limit is not None or host_memory_limit is not None or \
                host_burst is not None or headroom_given or options:
            return dmem.Runtime(**kw), True
    return dmem.default_runtime(device), False


def _device_target(runtime, device_memory_limit):
    """The stored keys' device bytes DmemWorkerData keeps to: the bytes of
    device_memory_limit ("N%" of the device's capacity), or None (none
    given: the runtime's limit alone)."""
    limit = parse_size(device_memory_limit, "device_memory_limit")
    if limit is None:
        return None
    if isinstance(limit, str):
        frac = float(limit.strip()[:-1]) / 100.0
        if not 0 < frac <= 1:
            raise ValueError(f"device_memory_limit {limit!r} is not a share of the device "
                             f"(0-100%)")
        return int(frac * runtime.stats()["device_capacity"])
    return limit


class DmemWorkerData(MutableMapping):
    """The data mapping of a dmem-backed Dask worker.

    Parameters
    ----------
    device_memory_limit, host_memory_limit:
        Bytes, or strings read as Dask reads them (dask.utils.parse_bytes:
        ``"8GB"`` is 8e9 bytes, ``"8GiB"`` 2**33), or ``"80%"`` of the
        device for device_memory_limit. device_memory_limit bounds the
        device bytes of stored keys, as dask-cuda's does: past it the
        mapping spills keys (cold, then least recently used) right after a
        store or a task's read, while a task's temporaries and its output
        being computed are not counted. The runtime's own device limit, on
        every byte, stays the device's (``DMEM_DEVICE_LIMIT`` or the card;
        on the host backend, device_memory_limit itself). With
        ``runtime=``, device_memory_limit is still the stored keys' bound.
        host_memory_limit is the runtime's pinned host limit. None: no
        bound of the mapping's own / the ``DMEM_*`` environment, dmem's
        defaults.
    host_burst:
        How far past host_memory_limit (a fraction of it, 0 to 1) the host
        tier may grow while it is pushed down to disk (dmem.Runtime's
        host_burst; None: ``DMEM_HOST_BURST`` or 0.5). The pinned memory of
        the worker grows to about host_memory_limit * (1 + host_burst) plus
        staging under sustained spilling: less burst with a higher limit
        holds more spilled data in the same memory.
    host_headroom:
        The most free pinned host memory the pinned pool keeps ahead of
        spills (dmem.Runtime's host_headroom): bytes or a string as Dask
        reads it. None: ``DMEM_HOST_HEADROOM``, else DASK_HOST_HEADROOM (0:
        the pool grows only by what spills need, so that it holds little
        more than the spilled data; docs/dask.md, "Host memory"). dmem's own
        default, 4 GiB, pins ahead of bursts of spills at the price of up to
        that much pinned memory left unused.
    spill_dir:
        Where dmem's disk tier puts its (unlinked) files; default: the
        worker's local directory.
    runtime:
        A dmem.Runtime to use instead (it is not closed by the mapping).
    backend, device:
        As for dmem.Runtime (``"host"`` keeps device arrays in host memory).
    host_target:
        Bytes of host values (NumPy, pandas, ...) kept in memory before the
        SpillBuffer writes the oldest to disk by itself; default: only when
        the worker's memory manager asks (``evict``).
    worker_local_directory:
        Given by distributed's worker.
    **runtime_options:
        Any other keyword of dmem.Runtime (RUNTIME_OPTIONS: ``eviction_policy``,
        ``host_reserve``, ``log_level``, ...), given to the worker's runtime
        as it is; None: the ``DMEM_*`` environment / dmem's default.

    Pass it to a worker as ``data=(DmemWorkerData, {...})``, or use
    dmem.dask.LocalCluster / ``python -m dmem.dask.worker``.
    """

    def __init__(self, device_memory_limit=None, host_memory_limit=None, spill_dir=None, *,
                 runtime=None, backend=None, device=None, host_target=None, host_burst=None,
                 host_headroom=None, worker_local_directory=None, **runtime_options):
        from distributed.spill import SpillBuffer

        check_runtime_options(runtime_options, "DmemWorkerData()")

        global _current
        local = worker_local_directory or spill_dir
        self._made_local = None  # a folder this mapping made: removed by close()
        if local is None:
            import tempfile

            local = self._made_local = tempfile.mkdtemp(prefix="dmem-dask-")
        if runtime is not None:
            if not isinstance(runtime, dmem.Runtime):
                raise TypeError(f"runtime must be a dmem.Runtime, not {type(runtime).__name__}")
            if runtime.closed:
                raise ValueError("runtime is closed")
            self.runtime, self._owned = runtime, False
        else:
            self.runtime, self._owned = _runtime_for(
                backend, device, device_memory_limit, host_memory_limit,
                spill_dir if spill_dir is not None else local, host_burst, host_headroom,
                runtime_options)
        self._target = _device_target(self.runtime, device_memory_limit)
        self._target_lock = threading.Lock()
        if host_target is None:
            host_target = sys.maxsize
        elif not isinstance(host_target, int) or isinstance(host_target, bool) or host_target < 0:
            raise ValueError(f"host_target must be a non-negative int, not {host_target!r}")
        self.host = SpillBuffer(os.path.join(local, "storage"), target=host_target)
        self._dev = {}
        self._lru = collections.OrderedDict()  # device keys, least recently used first
        self._cold = set()  # device keys whose buffers have priority COLD
        self._lock = threading.Lock()
        self._worker = None
        self.counts = collections.Counter()  # adopted, copied, fallbacks, evictions, sent, prefetched
        self._controller = None
        if self.runtime.controller is None:
            self._controller = _Victims(self)
            self.runtime.set_controller(self._controller)
        else:
            logger.warning("dmem.dask: the runtime already has a controller; "
                           "spill victims are not chosen by task key")
        _current = weakref.ref(self)

    # ---- the worker -------------------------------------------------------------

    def attach(self, worker):
        """Called by DmemWorkerPlugin: the worker whose ready tasks make keys hot."""
        self._worker = weakref.ref(worker) if worker is not None else None

    def _stream(self):
        if self.runtime.backend != "cuda":
            return None
        cp = sys.modules.get("cupy")
        if cp is None:
            return None
        ptr = cp.cuda.get_current_stream().ptr
        return ptr or None

    # ---- MutableMapping ----------------------------------------------------------

    def __setitem__(self, key, value):
        if key in self:
            del self[key]
        if isinstance(value, DmemValue):  # a stored value given back to us
            value = _arrays.materialize(value.tree, value.device)
        try:
            tree, leaves = _arrays.pack(self.runtime, value, self._stream())
        except (MemoryError, dmem.DmemError) as e:
            # nothing could make room (everything locked): keep the value as
            # it is rather than lose it
            logger.warning("dmem.dask: %r kept outside dmem: %s", key, e)
            self.counts["fallbacks"] += 1
            tree = None
        if tree is None:
            self.host[key] = value
            return
        for leaf in leaves:
            self.counts["adopted" if leaf.adopted else "copied"] += 1
        with self._lock:
            self._dev[key] = _Entry(tree, leaves)
            self._lru[key] = None
        self._cool_dependencies(key)
        self._keep_to_target()

    def __getitem__(self, key):
        with self._lock:
            entry = self._dev.get(key)
            if entry is not None:
                self._lru.move_to_end(key)
        if entry is None:
            return self.host[key]
        transfer = for_transfer.get()
        if transfer:
            self.counts["sent"] += 1
            with self._lock:
                if entry.released:  # deleted since we looked it up
                    raise KeyError(key)
                entry.pins += 1
            value = DmemValue(entry.tree, self.runtime.backend == "cuda",
                              transfer if isinstance(transfer, Transfer) else None)
            weakref.finalize(value, _unpin, self._lock, entry)
            return value
        if key in self._cold:  # a task needs it after all (a new graph)
            self._set_priority(key, entry, 0)
        value = _arrays.unpack(entry.tree, self._stream())
        self._keep_to_target()  # it may have come back from the host
        return value

    def __delitem__(self, key):
        with self._lock:
            entry = self._dev.pop(key, None)
            if entry is not None:
                del self._lru[key]
                self._cold.discard(key)
        if entry is None:
            del self.host[key]
            return
        _release(self._lock, entry)

    def __contains__(self, key):
        return key in self._dev or key in self.host

    def __iter__(self):
        yield from list(self._dev)
        yield from list(self.host)

    def __len__(self):
        return len(self._dev) + len(self.host)

    def __repr__(self):
        return (f"<DmemWorkerData: {len(self._dev)} device keys, {len(self.host)} host keys, "
                f"runtime {self.runtime.backend}:{self.runtime.device}>")

    # ---- where the bytes are ------------------------------------------------------

    def tier_of(self, key):
        """'device', 'host', 'disk' (where most of a device key's bytes are;
        'mixed' if its arrays are in several tiers), or 'host-value' /
        'host-value-disk' for keys of the SpillBuffer."""
        entry = self._dev.get(key)
        if entry is None:
            if key in self.host.fast:
                return "host-value"
            if key in self.host:
                return "host-value-disk"
            raise KeyError(key)
        tiers = {_TIER[leaf.buf.state] for leaf in entry.leaves}
        return tiers.pop() if len(tiers) == 1 else "mixed"

    def _hot_keys(self):
        w = self._worker() if self._worker is not None else None
        if w is None:
            return frozenset()
        hot = set()
        try:
            state = w.state
            for group in (state.ready, state.executing, getattr(state, "constrained", ())):
                for ts in list(group):
                    hot.update(dep.key for dep in ts.dependencies)
        except Exception:  # the worker changed it under us: no preference then
            return frozenset()
        return hot

    def _cool_dependencies(self, key):
        """key's task has run: each of its dependencies that no task on this
        worker still needs becomes cold (priority COLD), the first to leave
        the device and, under host_memory_limit, the host tier. A persisted
        array read by a graph is cold once the graph's tasks here are done,
        while arrays the next tasks read stay warm. Without a worker (the
        mapping alone), or when the worker's state changes under us, nothing
        is cooled."""
        w = self._worker() if self._worker is not None else None
        if w is None:
            return
        try:
            ts = w.state.tasks.get(key)
            deps = list(ts.dependencies) if ts is not None else ()
            # ts itself is still "executing" while its result is stored
            done = [d.key for d in deps if d.key not in self._cold and
                    not any(x is not ts and x.state in _PENDING for x in d.dependents)]
        except Exception:  # the worker changed it under us: no preference then
            return
        for k in done:
            entry = self._dev.get(k)
            if entry is not None:
                self._set_priority(k, entry, COLD)

    def _set_priority(self, key, entry, priority):
        for leaf in entry.leaves:
            try:
                leaf.buf.priority = priority
            except dmem.StaleHandleError:  # freed meanwhile
                pass
        with self._lock:
            if key in self._dev:
                (self._cold.add if priority == COLD else self._cold.discard)(key)

    def _keep_to_target(self):
        """Spill stored keys (by _victims' order) until the bytes of dmem
        buffers on the device are within device_memory_limit, as
        dask-cuda's device LRU does; memory that is not a stored buffer (a
        task's temporaries and output being computed: raw allocations) is
        not counted, and the runtime's own limit still bounds every byte."""
        if self._target is None:
            return
        # one thread at a time: two that both saw the excess would spill it
        # twice; a thread that finds another at it leaves it to that one
        if not self._target_lock.acquire(blocking=False):
            return
        try:
            s = self.runtime.stats()
            over = s["device_used"] - s["raw_used"] - self._target
            if over > 0:
                try:
                    self.runtime.evict(over)
                except dmem.DmemError as e:  # the runtime's limit still holds
                    logger.debug("dmem.dask: keeping to the device target: %s", e)
                self.counts["target_evictions"] += 1
        finally:
            self._target_lock.release()

    def _victims(self, nbytes):
        """Buffers to spill for nbytes of room: resident, unlocked buffers of
        cold keys (no task here needs them), then of keys no ready task
        needs, then of those ready tasks need, least recently used first in
        each group."""
        with self._lock:
            order = [(k, self._dev[k]) for k in self._lru]
            cold = set(self._cold)
        hot = self._hot_keys()
        victims, freed = [], 0
        for group in (0, 1, 2):
            for key, entry in order:
                if (0 if key in cold else 2 if key in hot else 1) != group:
                    continue
                for leaf in entry.leaves:
                    b = leaf.buf
                    try:
                        if b.state == "resident" and b.lock_count == 0:
                            victims.append(b)
                            freed += b.size
                    except dmem.StaleHandleError:
                        continue
                if freed >= nbytes:
                    return victims
        return victims or None

    def prefetch(self, keys):
        """Start bringing the spilled arrays of these keys back to the device
        (dmem_buffer_prefetch: stream-ordered copies, nothing locked), so that the
        tasks about to read them do not wait for the copies. Keys that are
        gone or hold host values are skipped. Returns the number of buffers
        asked for. Never raises: when the device has no room even after
        spilling colder keys, what was started stays started and the rest
        is left to the tasks' own locks."""
        with self._lock:
            entries = [self._dev.get(k) for k in keys]
        bufs = []
        for e in entries:
            if e is None:
                continue
            for leaf in e.leaves:
                try:
                    if leaf.buf.state in ("deferred_host", "deferred_disk"):
                        bufs.append(leaf.buf)
                except dmem.StaleHandleError:
                    continue
        if not bufs:
            return 0
        try:
            self.runtime.prefetch(bufs, self._stream())
        except (MemoryError, dmem.DmemError) as e:
            logger.debug("dmem.dask: prefetch of %d buffers stopped: %s", len(bufs), e)
        self.counts["prefetched"] += len(bufs)
        return len(bufs)

    # ---- ManualEvictProto -----------------------------------------------------------

    @property
    def fast(self):
        """What evict() could still move: device keys with bytes in dmem's
        host tier, then the SpillBuffer's in-memory values."""
        with self._lock:
            entries = list(self._dev.items())
        movable = [k for k, e in entries if any(_host_tier(leaf.buf) for leaf in e.leaves)]
        return movable + list(self.host.fast)

    def evict(self):
        """Move the coldest key's host-tier bytes to dmem's disk tier: cold
        keys (no task here needs them) first, then the least recently used
        (or, when there are none, the SpillBuffer's oldest value to disk).
        Returns the bytes moved out of memory, or -1. Never raises."""
        try:
            with self._lock:
                order = [(k, self._dev[k]) for k in self._lru]
                cold = set(self._cold)
            order.sort(key=lambda kv: kv[0] not in cold)  # stable: LRU within each
            for key, entry in order:
                moved = 0
                for leaf in entry.leaves:
                    if _host_tier(leaf.buf):
                        try:
                            leaf.buf.spill("disk")
                            moved += leaf.buf.size
                        except (dmem.BusyError, dmem.StaleHandleError):
                            continue
                if moved:
                    self.counts["evictions"] += 1
                    try:
                        self.runtime.host_trim(0)  # so that RSS falls
                    except dmem.DmemError:
                        pass
                    return moved
            if self.host.fast:
                return self.host.evict()
            return -1
        except Exception as e:  # the protocol: log, keep the value, return -1
            logger.error("dmem.dask: evict failed: %s", e)
            return -1

    @property
    def spilled_total(self):
        """(bytes of values on disk, bytes they take there), as SpillBuffer
        reports it: dmem's disk tier plus the SpillBuffer's files."""
        disk = self.runtime.stats()["disk_used"]
        mem, ondisk = self.host.spilled_total
        return (mem + disk, ondisk + disk)

    def metrics(self):
        """The numbers the worker reports each heartbeat (dmem.dask.plugin)."""
        s = self.runtime.stats()
        return {
            "dmem-device-bytes": s["device_used"],
            "dmem-host-bytes": s["host_used"],
            "dmem-disk-bytes": s["disk_used"],
            "dmem-spilled-bytes": s["bytes_spilled"],
            "dmem-unspilled-bytes": s["bytes_unspilled"],
            "dmem-spill-count": s["spill_count"],
            "dmem-device-keys": len(self._dev),
            "dmem-adopted": self.counts["adopted"],
            "dmem-copied": self.counts["copied"],
            "dmem-prefetched": self.counts["prefetched"],
        }

    def close(self):
        """Free every stored buffer (those of values still on their way to
        another process when these are gone); close the runtime if the
        mapping made it. Host values are dropped too."""
        with self._lock:
            entries = list(self._dev.values())
            self._dev.clear()
            self._lru.clear()
        for entry in entries:
            _release(self._lock, entry)
        self.host.clear()
        if self._controller is not None and not self.runtime.closed:
            try:
                self.runtime.set_controller(None)
            except dmem.DmemError:
                pass
        if self._owned and not self.runtime.closed:
            try:
                self.runtime.close()
            except dmem.BusyError:  # arrays still exposed: closed at exit
                pass
        if self._made_local is not None:
            import shutil

            shutil.rmtree(self._made_local, ignore_errors=True)
            self._made_local = None


_TIER = {
    "resident": "device",
    "deferred_host": "host",
    "deferred_disk": "disk",
    "deferred_controller": "controller",
    "spilling": "device",  # a move in flight: its bytes are still there
    "unspilling": "device",  # on the way back: counted where it is going
}


def _host_tier(buf):
    try:
        return buf.state == "deferred_host"
    except dmem.StaleHandleError:
        return False
