"""A model-checked Python API (issue 12, item 3).

A hypothesis RuleBasedStateMachine drives dmem's Python API on the host
backend (a 64 KiB simulated device, so that allocations spill others) against
a pure-Python model of every buffer: its bytes, its tier, its priority,
whether it is pinned, and the exports (arrays, memoryviews, DLPack capsules
and tensors, views whose array interface was taken, exports held in reference
cycles) that keep it locked. The rules: alloc, write, read, free, lock (views
used then left by __exit__, by an exception or by dropping them; exports
kept, written, read and dropped), spill to each tier (host, disk in a
temporary spill directory, and the controller tier of a dmem.Controller
subclass that keeps the bytes in a dict), unspill, evict, priorities, and a
controller whose store or retrieve raises (the buffer must stay where it was
with its bytes intact, and the call raise CallbackError with the original as
__cause__).

Every read (Buffer.read, a view, an export) must equal the model. After every
rule the invariants compare each buffer's state, lock count and `exposed`
flag, the runtime's buffer and export counts and the controller's stored keys
with the model. Other buffers may change state only by eviction (resident ->
deferred_host, never a pinned or exposed one), and only in a rule that needs
device memory.

Half the examples give the runtime an 8 KiB host limit, so that the I/O
threads push host-tier buffers down to disk while the rules run; the model
then also accepts what that may do meanwhile (deferred_host -> deferred_disk,
BusyError "being moved" from an explicit spill, a freed buffer reclaimed
when its write to disk ends).

CI runs a fixed, derandomised set of 40 examples (about 6 s on 2 cores);
DMEM_HYPOTHESIS_EXAMPLES=N runs N random ones (add --hypothesis-seed=S to
pytest to vary them; several runs of a few hundred rather than one huge one).
"""

import gc
import os
import random
import shutil
import tempfile
import time

import pytest

import dmem

np = pytest.importorskip("numpy")
pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, event, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

KB = 1 << 10
CAP = 64 * KB  # simulated device memory
MAX_SIZE = 12 * KB  # largest buffer
MAX_LIVE = 10  # live buffers at most (together up to ~2x the device)
EXPORT_MAX_SIZE = 8 * KB  # only buffers up to this size get exports
MAX_EXPOSED_VIEWS = 3
MAX_PINNED = 2
PINNED_MAX_SIZE = 4 * KB
TIERS = ("host", "disk", "controller")
STATE_OF_TIER = {t: "deferred_" + t for t in TIERS}
EXPORT_KINDS = ("asarray", "memoryview", "from_dlpack", "capsule", "iface", "cycle")
WRITABLE_KINDS = ("asarray", "memoryview", "from_dlpack", "iface", "cycle")
# the bridge's kind of each export (rt.stats()["exports"], view.exports)
BRIDGE_KIND = {"asarray": "buffer", "memoryview": "buffer", "cycle": "buffer",
               "from_dlpack": "dlpack", "capsule": "dlpack", "iface": "array_interface"}

EXAMPLES = int(os.environ.get("DMEM_HYPOTHESIS_EXAMPLES") or 0)


def pattern(seed, n):
    return random.Random(seed).randbytes(n)


def rounded(n):
    """An upper bound of the device bytes a buffer of n bytes occupies (pool
    size classes and alignment)."""
    return n + n // 4 + 256


class ControllerFailure(Exception):
    pass


class DictController(dmem.Controller):
    """The controller tier in a dict; store or retrieve raise on demand."""

    def __init__(self):
        self.stored = {}
        self.fail = None  # None, "store" or "retrieve"

    def on_free(self, handle):
        self.stored.pop(handle, None)

    def store(self, buf, data):
        if self.fail == "store":
            raise ControllerFailure("store refused")
        self.stored[buf.handle] = bytes(data)

    def retrieve(self, buf, out):
        if self.fail == "retrieve":
            raise ControllerFailure("retrieve refused")
        out[:] = self.stored.pop(buf.handle)


class Consumer:
    """A library that builds its array from __array_interface__ and keeps the
    object that provided it: numpy.asarray(Consumer(view)) keeps the view."""

    def __init__(self, view):
        self.view = view

    @property
    def __array_interface__(self):
        return self.view.__array_interface__


class Cycle:
    """An export only the cyclic GC can free."""


class Rec:
    """The model of one buffer."""

    def __init__(self, buf, data, pinned, priority):
        self.buf = buf
        self.handle = buf.handle
        self.size = len(data)
        self.data = bytearray(data)
        self.pinned = pinned
        self.priority = priority
        self.state = "resident"
        self.views = 0  # kept exports: each holds its own view (one lock)
        self.freed = False


class Export:
    def __init__(self, kind, obj, rec):
        self.kind = kind
        self.obj = obj
        self.rec = rec

    def array(self):
        """A NumPy array over the export's bytes (None for a capsule)."""
        if self.kind == "capsule":
            return None
        if self.kind == "cycle":
            return self.obj.arr
        if self.kind == "memoryview":
            return np.frombuffer(self.obj, dtype=np.uint8)
        return self.obj


class DmemModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="dmem-model-")
        self.rt = dmem.Runtime(backend="host", host_capacity=CAP, spill_dir=self.dir)
        self.ctrl = DictController()
        self.rt.set_controller(self.ctrl)
        self.live = []  # Recs of buffers not freed
        self.zombies = []  # freed Recs whose exports still hold their memory
        self.exports = []
        self.pushdown = False  # a host limit: the host tier pushes buffers to disk
        self.stream = None

    def teardown(self):
        try:
            self.ctrl.fail = None
            for r in self.live:
                assert r.buf.read() == bytes(r.data)
            for e in self.exports:
                a = e.array()
                if a is not None:
                    assert a.tobytes() == bytes(e.rec.data)
        finally:
            self.exports.clear()
            gc.collect()
            if self.stream is not None:
                self.stream.close()
            try:
                self.rt.close()
            except dmem.BusyError:  # a failed rule's frame still holds an export
                pass
            shutil.rmtree(self.dir, ignore_errors=True)

    # ---- helpers -------------------------------------------------------------------

    def pick(self, i):
        return self.live[i % len(self.live)]

    def exposed_views(self):
        return sum(r.views for r in self.live + self.zombies)

    def unevictable(self):
        return [r for r in self.live if r.pinned or r.views] + self.zombies

    def oom_allowed(self, size):
        """True when no placement of the unevictable blocks can leave a gap
        of `size` bytes: their largest gap is at least the average one."""
        blocks = self.unevictable()
        used = sum(rounded(r.size) for r in blocks)
        return rounded(size) > (CAP - used) / (len(blocks) + 1)

    def absorb(self, r):
        """Take in a move the runtime may make on its own: the host tier's
        push-down to disk (with a host limit). Returns the buffer's state."""
        now = r.buf.state
        if now != r.state and self.pushdown and (r.state, now) == ("deferred_host",
                                                                    "deferred_disk"):
            event("pushed down to disk")
            r.state = now
        return now

    def check_others(self, target, may_evict):
        """Buffers other than target change only by eviction, in a rule that
        needed device memory (and by push-down, with a host limit)."""
        for r in self.live:
            if r is target:
                continue
            now = self.absorb(r)
            if now == r.state:
                continue
            evicted_to = ("deferred_host", "deferred_disk") if self.pushdown else (
                "deferred_host",)
            assert may_evict, f"{r.handle:#x} went {r.state} -> {now} by itself"
            assert r.state == "resident" and now in evicted_to, (r.state, now)
            assert not r.pinned and r.views == 0, "a pinned or exposed buffer was evicted"
            r.state = now

    def retrieving(self, r, fn):
        """Run fn, an operation that locks r (bringing it back to the
        device). Returns (True, fn's result), or (False, None) when it failed
        as the model allows: the controller's retrieve raised, or the device
        cannot hold r beside the unevictable buffers."""
        self.absorb(r)
        was = r.state
        retrieve_fails = was == "deferred_controller" and self.ctrl.fail == "retrieve"
        try:
            res = fn()
        except dmem.CallbackError as e:
            assert retrieve_fails, f"unexpected CallbackError from {was}: {e}"
            event("retrieve raised")
            assert isinstance(e.__cause__, ControllerFailure)
            assert self.absorb(r) == was
            self.check_others(r, may_evict=True)
            return False, None
        except dmem.OutOfMemoryError as e:
            assert was != "resident", f"a resident buffer could not be locked: {e}"
            assert self.oom_allowed(r.size), (
                f"OutOfMemoryError for {r.size} bytes with only "
                f"{sum(x.size for x in self.unevictable())} unevictable: {e}")
            assert self.absorb(r) == was
            self.check_others(r, may_evict=True)
            event("lock: out of memory")
            return False, None
        assert not retrieve_fails, "the controller's retrieve raised but the call succeeded"
        r.state = "resident"
        self.check_others(r, may_evict=was != "resident")
        return True, res

    # ---- buffers -------------------------------------------------------------------------

    @initialize(sizes=st.lists(st.integers(1, MAX_SIZE), min_size=1, max_size=4),
                seed=st.integers(0, 1 << 30), host_limit=st.sampled_from([None, 8 * KB]))
    def some_buffers(self, sizes, seed, host_limit):
        if host_limit is not None:  # the variant whose host tier pushes down to disk
            self.rt.close()
            self.rt = dmem.Runtime(backend="host", host_capacity=CAP, spill_dir=self.dir,
                                   host_limit=host_limit)
            self.rt.set_controller(self.ctrl)
            self.pushdown = True
        self.stream = self.rt.stream()
        for k, size in enumerate(sizes):
            self.alloc(size, seed + k, 0, False)

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(size=st.integers(1, MAX_SIZE), seed=st.integers(0, 1 << 30),
          priority=st.integers(-2, 2), pinned=st.booleans())
    def alloc(self, size, seed, priority, pinned):
        pinned = (pinned and size <= PINNED_MAX_SIZE
                  and sum(r.pinned for r in self.live) < MAX_PINNED)
        try:
            b = self.rt.alloc(size, priority=priority, pinned=pinned)
        except dmem.OutOfMemoryError as e:
            assert self.oom_allowed(size), (
                f"alloc({size}) OutOfMemoryError with only "
                f"{sum(x.size for x in self.unevictable())} unevictable: {e}")
            self.check_others(None, may_evict=True)
            event("alloc: out of memory")
            return
        self.check_others(None, may_evict=True)
        data = pattern(seed, size)
        r = Rec(b, data, pinned, priority)
        assert b.size == size and b.state == "resident" and b.pinned == pinned
        assert b.priority == priority
        b.write(data)  # resident and just allocated: cannot fail
        self.live.append(r)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, MAX_LIVE), data=st.data())
    def write(self, i, data):
        r = self.pick(i)
        off = data.draw(st.integers(0, r.size - 1), label="offset")
        n = data.draw(st.integers(0, r.size - off), label="nbytes")
        chunk = pattern(data.draw(st.integers(0, 1 << 30), label="seed"), n)
        ok, _ = self.retrieving(r, lambda: r.buf.write(chunk, off))
        if ok:
            r.data[off:off + n] = chunk

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, MAX_LIVE), data=st.data())
    def read(self, i, data):
        r = self.pick(i)
        off = data.draw(st.integers(0, r.size), label="offset")
        n = data.draw(st.one_of(st.none(), st.integers(0, r.size - off)), label="nbytes")
        ok, got = self.retrieving(r, lambda: r.buf.read(n, off))
        if ok:
            end = r.size if n is None else off + n
            assert got == bytes(r.data[off:end])

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, MAX_LIVE))
    def free(self, i):
        r = self.live.pop(i % len(self.live))
        r.buf.free()
        r.freed = True
        if r.views:  # deferred: the exports keep the memory
            self.zombies.append(r)
            event("free of an exposed buffer")
        with pytest.raises(dmem.StaleHandleError):
            r.buf.read(1)
        with pytest.raises(dmem.StaleHandleError):
            r.buf.spill("host")
        self.check_others(None, may_evict=False)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, MAX_LIVE), priority=st.integers(-2, 2))
    def set_priority(self, i, priority):
        r = self.pick(i)
        r.buf.priority = priority
        r.priority = priority
        assert r.buf.priority == priority

    # ---- tiers -----------------------------------------------------------------------------

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, MAX_LIVE), tier=st.sampled_from(TIERS))
    def spill(self, i, tier):
        r = self.pick(i)
        self.absorb(r)
        was, target = r.state, STATE_OF_TIER[tier]
        busy = r.pinned or r.views > 0
        # with a host limit, a host-tier buffer may reach the disk meanwhile
        origins = [was] + (["deferred_disk"] if self.pushdown and was == "deferred_host" else [])

        def can_move(o):
            return o == "resident" or o == target or (
                o == "deferred_host" and tier in ("disk", "controller"))

        movable = any(can_move(o) for o in origins)
        store_fails = tier == "controller" and was != target and self.ctrl.fail == "store"
        try:
            r.buf.spill(tier)
        except dmem.BusyError as e:
            if not busy and len(origins) > 1 and "being moved" in str(e):
                # documented: BUSY while another thread (here the push-down
                # to disk) moves the buffer
                event("spill: busy (being pushed down)")
                assert self.absorb(r) in origins
                self.check_others(r, may_evict=False)
                return
            assert busy, f"spill({tier!r}) of an unlocked buffer: {e}"
            event("spill: busy (exposed)" if r.views else "spill: busy (pinned)")
            if r.views:
                kinds = {BRIDGE_KIND[x.kind] for x in self.exports if x.rec is r}
                words = {"buffer": "buffer-protocol", "array_interface": "array-interface",
                         "dlpack": "DLPack"}
                for k in kinds:
                    assert words[k] in str(e), (k, str(e))
            assert r.buf.state == was
        except dmem.InvalidArgumentError:
            assert not busy and not all(can_move(o) for o in origins), (
                f"spill {was} -> {tier} refused")
            event("spill: not movable")
            assert self.absorb(r) in origins and not can_move(r.state)
        except dmem.CallbackError as e:
            assert not busy and movable and store_fails, f"spill {was} -> {tier}: {e}"
            assert isinstance(e.__cause__, ControllerFailure)
            assert self.absorb(r) == was  # intact where it was
            event("store raised")
        else:
            assert not busy and movable and not store_fails, f"spill {was} -> {tier} succeeded"
            r.state = target
            self.absorb(r)
            assert r.buf.state == r.state
            event(f"spill: {was} -> {target}")
        self.check_others(r, may_evict=False)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, MAX_LIVE))
    def unspill(self, i):
        r = self.pick(i)

        def unspill_and_wait():
            r.buf.unspill()
            self.rt.synchronize()

        self.retrieving(r, unspill_and_wait)
        if r.state == "resident":
            assert r.buf.state == "resident"

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, MAX_LIVE), on_stream=st.booleans())
    def prefetch(self, i, on_stream):
        """Bring a buffer back without locking it (buf.prefetch, or
        rt.prefetch of it and another one), then wait for the stream."""
        r = self.pick(i)
        s = self.stream if on_stream else None

        def prefetch_and_wait():
            r.buf.prefetch(s)
            self.rt.synchronize(s)

        self.retrieving(r, prefetch_and_wait)
        if r.state == "resident":
            assert r.buf.state == "resident" and r.buf.lock_count == r.views

    @precondition(lambda self: self.live)
    @rule(nbytes=st.integers(1, 2 * CAP))
    def evict(self, nbytes):
        spillable = [r for r in self.live
                     if r.state == "resident" and not r.pinned and not r.views]
        freed = self.rt.evict(nbytes)
        spilled = [r for r in spillable if r.buf.state != "resident"]
        kept = [r for r in spillable if r not in spilled]
        for r in spilled:
            r.state = "deferred_host"  # the victims' tier (then maybe pushed down)
            assert self.absorb(r) == r.state
        assert freed == sum(r.size for r in spilled)
        assert freed >= min(nbytes, sum(r.size for r in spillable))
        if freed > nbytes:  # it stopped as soon as it had enough
            assert any(freed - r.size < nbytes for r in spilled)
        event(f"evict: {min(len(spilled), 3)}+ victims")
        if spilled and kept:  # lowest priority first
            assert max(r.priority for r in spilled) <= min(r.priority for r in kept)
        self.check_others(None, may_evict=False)  # nothing else moved

    @rule(mode=st.sampled_from([None, None, "store", "retrieve"]))
    def controller_fails(self, mode):
        """From now on the controller's store or retrieve raise (or not)."""
        self.ctrl.fail = mode

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, MAX_LIVE))
    def spill_with_failing_store(self, i):
        old, self.ctrl.fail = self.ctrl.fail, "store"
        try:
            self.spill(i, "controller")
        finally:
            self.ctrl.fail = old

    @precondition(lambda self: any(r.state == "deferred_controller" for r in self.live))
    @rule(i=st.integers(0, MAX_LIVE), op=st.sampled_from(["read", "write", "lock", "unspill"]))
    def retrieve_fails(self, i, op):
        """Every way of bringing a controller-tier buffer back raises
        CallbackError when retrieve raises; the buffer stays there, intact."""
        held = [r for r in self.live if r.state == "deferred_controller"]
        r = held[i % len(held)]
        old, self.ctrl.fail = self.ctrl.fail, "retrieve"
        try:
            if op == "read":
                ok = self.retrieving(r, r.buf.read)[0]
            elif op == "write":
                ok = self.retrieving(r, lambda: r.buf.write(b"\xff" * r.size))[0]
            elif op == "lock":
                ok = self.retrieving(r, r.buf.lock().__enter__)[0]
            else:
                ok = self.retrieving(r, r.buf.unspill)[0]
        finally:
            self.ctrl.fail = old
        assert not ok and r.buf.state == "deferred_controller"

    # ---- lock views --------------------------------------------------------------------------

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, MAX_LIVE), how=st.sampled_from(["exit", "raise", "drop"]),
          mutate=st.booleans(), on_stream=st.booleans(), data=st.data())
    def lock_use(self, i, how, mutate, on_stream, data):
        """A view used inside its block (locked on the default stream or on a
        dmem.Stream), then left by __exit__, by an exception, or by dropping
        the entered view."""
        r = self.pick(i)
        v = r.buf.lock(self.stream if on_stream else None)
        ok = self.retrieving(r, v.__enter__)[0]  # (its result is v itself)
        if not ok:
            return
        assert v.locked and r.buf.lock_count == r.views + 1
        a = np.asarray(v)
        assert a.tobytes() == bytes(r.data)
        if mutate:
            off = data.draw(st.integers(0, r.size - 1), label="offset")
            chunk = pattern(data.draw(st.integers(0, 1 << 30), label="seed"), r.size - off)
            a[off:] = np.frombuffer(chunk, dtype=np.uint8)
            r.data[off:] = chunk
        del a
        if how == "exit":
            v.__exit__(None, None, None)
        elif how == "raise":  # what `with` does when the block raises
            assert v.__exit__(KeyError, KeyError("inside the block"), None) is False
        del v
        assert r.buf.lock_count == r.views
        assert r.buf.exposed == (r.views > 0)

    @precondition(lambda self: self.live and self.exposed_views() < MAX_EXPOSED_VIEWS
                  and any(r.size <= EXPORT_MAX_SIZE for r in self.live))
    @rule(i=st.integers(0, MAX_LIVE), kind=st.sampled_from(EXPORT_KINDS))
    def lock_export(self, i, kind):
        """An export made inside the block and kept after it."""
        small = [r for r in self.live if r.size <= EXPORT_MAX_SIZE]
        r = small[i % len(small)]
        v = r.buf.lock()
        ok = self.retrieving(r, v.__enter__)[0]  # (its result is v itself)
        if not ok:
            return
        try:
            if kind == "asarray":
                obj = np.asarray(v)
            elif kind == "memoryview":
                obj = memoryview(v)
            elif kind == "from_dlpack":
                obj = np.from_dlpack(v)
            elif kind == "capsule":
                obj = v.__dlpack__(max_version=(1, 0)) if r.size % 2 else v.__dlpack__()
            elif kind == "iface":
                obj = np.asarray(Consumer(v))
            else:
                obj = Cycle()
                obj.me = obj
                obj.arr = np.asarray(v)
            assert v.exports[BRIDGE_KIND[kind]] == 1
        finally:
            v.__exit__(None, None, None)
        assert not v.locked
        del v  # only the export holds the view now
        r.views += 1
        e = Export(kind, obj, r)
        self.exports.append(e)
        arr = e.array()
        if arr is not None:
            assert arr.tobytes() == bytes(r.data)
        assert r.buf.exposed and r.buf.state == "resident"

    @precondition(lambda self: any(e.kind in WRITABLE_KINDS for e in self.exports))
    @rule(j=st.integers(0, 2 * MAX_EXPOSED_VIEWS), data=st.data())
    def export_write(self, j, data):
        """Write through a kept export (its buffer may have been freed)."""
        ws = [e for e in self.exports if e.kind in WRITABLE_KINDS]
        e = ws[j % len(ws)]
        a = e.array()
        off = data.draw(st.integers(0, e.rec.size - 1), label="offset")
        value = data.draw(st.integers(0, 255), label="value")
        a[off] = value
        e.rec.data[off] = value

    @precondition(lambda self: self.exports)
    @rule(j=st.integers(0, 2 * MAX_EXPOSED_VIEWS))
    def export_read(self, j):
        e = self.exports[j % len(self.exports)]
        a = e.array()
        if a is not None:
            assert a.tobytes() == bytes(e.rec.data)

    @precondition(lambda self: self.exports)
    @rule(j=st.integers(0, 2 * MAX_EXPOSED_VIEWS))
    def drop_export(self, j):
        e = self.exports.pop(j % len(self.exports))
        r, kind = e.rec, e.kind
        del e
        if kind == "cycle":
            gc.collect()
        r.views -= 1
        if r.freed:
            if r.views == 0:
                self.zombies.remove(r)
        else:
            assert r.buf.exposed == (r.views > 0)
            assert r.buf.lock_count == r.views

    # ---- invariants ------------------------------------------------------------------------

    @invariant()
    def model_matches(self):
        for r in self.live:
            assert self.absorb(r) == r.state, (hex(r.handle), r.buf.state, r.state)
            assert r.buf.lock_count == r.views
            assert r.buf.exposed == (r.views > 0)
            if r.pinned or r.views:
                assert r.state == "resident"
        s = self.rt.stats()
        count = len(self.live) + len(self.zombies)
        if s["buffer_count"] != count and self.pushdown:
            # A buffer freed while the push-down writes it to disk is
            # reclaimed when that write ends: eventually, not at once.
            event("free reclaimed after its push-down")
            deadline = time.monotonic() + 5
            while s["buffer_count"] != count and time.monotonic() < deadline:
                time.sleep(0.002)
                self.rt.poll()
                s = self.rt.stats()
        assert s["buffer_count"] == count
        assert s["exposed"] == sum(1 for r in self.live + self.zombies if r.views)
        want = {"buffer": 0, "array_interface": 0, "dlpack": 0}
        for e in self.exports:
            want[BRIDGE_KIND[e.kind]] += 1
        assert s["exports"] == want
        assert set(self.ctrl.stored) == {
            r.handle for r in self.live if r.state == "deferred_controller"}


DmemModel.TestCase.settings = settings(
    max_examples=EXAMPLES or 40,
    stateful_step_count=50,
    deadline=None,
    derandomize=not EXAMPLES,  # CI: the same examples every run
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

TestDmemModel = DmemModel.TestCase
