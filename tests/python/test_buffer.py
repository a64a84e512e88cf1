"""dmem.Buffer: properties, read/write, spill/unspill on every tier, stale
handles and bad arguments."""

import array
import os

import pytest

import dmem

STATES = {"resident", "spilling", "deferred_host", "deferred_disk",
          "deferred_controller", "unspilling"}


def pattern(n, seed=0):
    return bytes((i * 31 + seed) & 0xFF for i in range(n))


def test_properties(rt):
    b = rt.alloc(1000)
    assert isinstance(b, dmem.Buffer)
    assert isinstance(b.handle, int) and b.handle != 0
    assert b.size == 1000
    assert b.state == "resident"
    assert b.lock_count == 0
    assert b.spill_count == 0
    assert b.priority == 0
    assert b.pinned is False
    assert b.runtime is rt
    r = repr(b)
    assert "dmem.Buffer" in r and "size=1000" in r and "resident" in r
    with pytest.raises(AttributeError):
        b.size = 5
    with pytest.raises(AttributeError):
        b.handle = 5
    with pytest.raises(TypeError):
        dmem.Buffer()


def test_priority_setter(rt):
    b = rt.alloc(10)
    b.priority = 5
    assert b.priority == 5
    b.priority = -(2 ** 31)
    assert b.priority == -(2 ** 31)
    with pytest.raises(TypeError):
        b.priority = "high"
    with pytest.raises(TypeError):
        b.priority = 1.0
    with pytest.raises(TypeError):
        b.priority = None
    with pytest.raises(ValueError):
        b.priority = 2 ** 31
    with pytest.raises(AttributeError):
        del b.priority


def test_equality_and_hash(rt):
    a, b = rt.alloc(8), rt.alloc(8)
    assert a == a and a != b
    assert hash(a) != hash(b) or a.handle != b.handle
    assert {a: 1}[a] == 1
    assert (a == 5) is False


def test_write_read_roundtrip(rt):
    b = rt.alloc(4096)
    data = pattern(4096)
    assert b.write(data) is None
    assert b.read() == data
    assert b.read(10) == data[:10]
    assert b.read(10, 100) == data[100:110]
    assert b.read(offset=4000) == data[4000:]
    assert b.read(0) == b""
    assert b.read(nbytes=None, offset=4096) == b""
    b.write(b"XYZ", 10)
    assert b.read(16) == data[:10] + b"XYZ" + data[13:16]
    b.write(b"", 4096)  # empty write at the end is fine


@pytest.mark.parametrize("make", [
    lambda d: bytearray(d),
    lambda d: memoryview(d),
    lambda d: memoryview(bytearray(d))[::1],
    lambda d: array.array("B", d),
])
def test_write_accepts_bytes_like(rt, make):
    b = rt.alloc(256)
    d = pattern(256, 3)
    b.write(make(d))
    assert b.read() == d


def test_write_numpy(rt):
    np = pytest.importorskip("numpy")
    b = rt.alloc(800)
    a = np.arange(100, dtype=np.float64)
    b.write(a)
    assert np.frombuffer(b.read(), dtype=np.float64).tolist() == a.tolist()
    with pytest.raises((TypeError, ValueError, BufferError)):
        b.write(np.arange(200, dtype=np.uint8)[::2])  # not contiguous


@pytest.mark.parametrize("args, kwargs, exc", [
    (("text",), {}, TypeError),
    ((123,), {}, TypeError),
    ((None,), {}, TypeError),
    ((b"x", "1"), {}, TypeError),
    ((b"x", 1.0), {}, TypeError),
    ((b"x",), {"where": 1}, TypeError),
    ((b"x", -1), {}, ValueError),
    ((b"x" * 65,), {}, ValueError),
    ((b"x" * 10, 60), {}, ValueError),
    ((b"x", 1 << 62), {}, ValueError),
])
def test_write_bad_arguments(rt, args, kwargs, exc):
    b = rt.alloc(64)
    with pytest.raises(exc):
        b.write(*args, **kwargs)


@pytest.mark.parametrize("args, kwargs, exc", [
    (("1",), {}, TypeError),
    ((1.0,), {}, TypeError),
    ((True,), {}, TypeError),
    ((1, "0"), {}, TypeError),
    ((-1,), {}, ValueError),
    ((65,), {}, ValueError),
    ((10, 60), {}, ValueError),
    ((None, 65), {}, ValueError),
    ((None, -1), {}, ValueError),
    ((1 << 70,), {}, ValueError),
])
def test_read_bad_arguments(rt, args, kwargs, exc):
    b = rt.alloc(64)
    with pytest.raises(exc):
        b.read(*args, **kwargs)


@pytest.mark.parametrize("tier, state", [("host", "deferred_host"), ("disk", "deferred_disk")])
def test_spill_unspill_roundtrip(rt, tier, state):
    b = rt.alloc(64 << 10)
    data = os.urandom(64 << 10)
    b.write(data)
    b.spill(tier)
    assert b.state == state
    assert b.spill_count == 1
    b.spill(tier)  # same tier: no-op
    assert b.spill_count == 1
    b.unspill()
    rt.synchronize()
    assert b.state == "resident"
    assert b.read() == data
    # read() of a spilled buffer retrieves it too
    b.spill(tier)
    assert b.read() == data
    assert b.state == "resident"


def test_spill_default_tier_is_host(rt):
    b = rt.alloc(100)
    b.spill()
    assert b.state == "deferred_host"


def test_spill_host_then_disk(rt):
    b = rt.alloc(8192)
    d = pattern(8192, 9)
    b.write(d)
    b.spill("host")
    b.spill("disk")
    assert b.state == "deferred_disk"
    with pytest.raises(dmem.InvalidArgumentError):
        b.spill("host")  # disk -> host is not a move the runtime makes
    assert b.read() == d


def test_unspill_on_stream(rt):
    b = rt.alloc(1 << 16)
    d = os.urandom(1 << 16)
    b.write(d)
    b.spill("disk")
    s = rt.stream()
    b.unspill(s)
    s.synchronize()
    assert b.state == "resident"
    b.unspill(stream=s)  # resident: left as it is
    assert b.read() == d
    s.close()


def test_spill_controller_without_controller(rt):
    b = rt.alloc(100)
    with pytest.raises(dmem.InvalidArgumentError):
        b.spill("controller")
    assert b.state == "resident"


@pytest.mark.parametrize("tier, exc", [(1, TypeError), (b"host", TypeError), (None, TypeError),
                                       ("gpu", ValueError), ("HOST", ValueError),
                                       ("device", ValueError)])
def test_spill_bad_tier(rt, tier, exc):
    b = rt.alloc(100)
    with pytest.raises(exc):
        b.spill(tier)


def test_spill_locked_is_busy(rt):
    b = rt.alloc(100)
    with b.lock():
        with pytest.raises(dmem.BusyError):
            b.spill()
        with pytest.raises(dmem.BusyError):
            b.spill("disk")
        assert b.state == "resident"
    b.spill()
    assert b.state == "deferred_host"


def test_spill_pinned_is_busy(rt):
    b = rt.alloc(100, pinned=True)
    with pytest.raises(dmem.BusyError):
        b.spill()
    assert b.state == "resident"


def test_free_then_everything_is_stale(rt):
    b = rt.alloc(100)
    s = rt.stream()
    b.free()
    uses = [
        lambda: b.read(), lambda: b.write(b"x"), lambda: b.spill(), lambda: b.unspill(),
        lambda: b.unspill(s), lambda: b.lock(), lambda: b.state, lambda: b.lock_count,
        lambda: b.spill_count, lambda: b.priority, lambda: b.pinned, lambda: b.free(),
        lambda: setattr(b, "priority", 1),
        lambda: rt.lock_and_launch([b], lambda st, p: None),
        lambda: rt.launch_async(s, [b], lambda st, p: None),
    ]
    for use in uses:
        with pytest.raises(dmem.StaleHandleError):
            use()
    assert "freed" in repr(b)
    assert b.size == 100 and b.handle != 0
    assert rt.stats()["buffer_count"] == 0
    s.close()


def test_free_while_locked(rt):
    b = rt.alloc(256)
    with b.lock() as v:
        b.free()
        assert v.ptr  # the lock taken before the free stays valid
        with pytest.raises(dmem.StaleHandleError):
            b.read()
    # memory reclaimed at the unlock
    assert rt.stats()["buffer_count"] == 0


def test_handles_not_reused_after_free(rt):
    a = rt.alloc(10)
    h = a.handle
    a.free()
    b = rt.alloc(10)
    assert b.handle != h


def test_buffer_keeps_runtime_alive():
    import gc
    import weakref
    r = dmem.Runtime(backend="host", host_capacity=1 << 20)
    b = r.alloc(100)
    ref = weakref.ref(r)
    del r
    gc.collect()
    assert ref() is not None
    assert b.runtime.backend == "host"
    del b
    gc.collect()
    assert ref() is None


def test_weakref_to_buffer(rt):
    import weakref
    b = rt.alloc(10)
    w = weakref.ref(b)
    assert w() is b
    del b
    assert w() is None


def test_prefetch_buffer_and_runtime(rt):
    bufs = [rt.alloc(4096) for _ in range(3)]
    for i, b in enumerate(bufs):
        b.write(pattern(4096, i))
    bufs[0].spill("host")
    bufs[1].spill("disk")
    bufs[0].prefetch()
    assert bufs[0].state == "resident" and bufs[0].lock_count == 0
    s = rt.stream()
    rt.prefetch(bufs, stream=s)
    assert [b.state for b in bufs] == ["resident"] * 3
    assert all(b.lock_count == 0 for b in bufs)
    for i, b in enumerate(bufs):
        assert b.read() == pattern(4096, i)
    st = rt.stats()
    assert st["prefetch_count"] == 2 and st["prefetch_bytes"] == 2 * 4096
    assert st["tier_unspill_count"]["disk"] == 1
    with pytest.raises(TypeError):
        rt.prefetch(5)
    with pytest.raises(TypeError):
        rt.prefetch([b"not a buffer"])
    rt.prefetch([])


def test_host_trim(rt):
    b = rt.alloc(1 << 20)
    b.spill("host")
    assert rt.stats()["host_pool_reserved"] >= 1 << 20
    assert rt.host_trim() == 0  # the host tier holds the copy
    b.free()
    released = rt.host_trim(0)
    assert released > 0 and rt.stats()["host_pool_reserved"] == 0
    with pytest.raises(TypeError):
        rt.host_trim("0")


# ---- peek / readinto: read where the bytes are, without moving the buffer ----

MOVES = ("spill_count", "unspill_count", "bytes_spilled", "bytes_unspilled")


def _moves(rt):
    st = rt.stats()
    return {k: st[k] for k in MOVES}


def _place(buf, tier):
    if tier != "device":
        buf.spill(tier)


@pytest.mark.parametrize("tier, state", [("device", "resident"), ("host", "deferred_host"),
                                         ("disk", "deferred_disk")])
def test_peek_and_readinto_leave_buffer_in_place(rt, tier, state):
    n = 3 * 4096 + 77
    data = pattern(n, 5)
    b = rt.alloc(n)
    b.write(data)
    _place(b, tier)
    spills = b.spill_count
    moves = _moves(rt)
    assert b.peek() == data
    assert b.peek(10) == data[:10]
    assert b.peek(offset=4095) == data[4095:]
    assert b.peek(5000, 4097) == data[4097:9097]
    assert b.peek(0) == b""
    assert b.peek(0, n) == b""
    out = bytearray(n)
    assert b.readinto(out) == n
    assert out == data
    part = bytearray(1001)
    assert b.readinto(part, offset=4093) == 1001
    assert part == data[4093:5094]
    mv = memoryview(bytearray(300))
    assert b.readinto(mv[100:200], 7) == 100
    assert mv[100:200] == data[7:107] and mv[:100] == bytes(100) and mv[200:] == bytes(100)
    assert b.readinto(bytearray()) == 0
    assert b.state == state
    assert b.spill_count == spills
    assert b.lock_count == 0
    assert _moves(rt) == moves
    assert b.read() == data  # read() still brings it back
    assert b.state == "resident"


def test_readinto_numpy(rt):
    np = pytest.importorskip("numpy")
    a = np.arange(10000, dtype=np.float64)
    b = rt.alloc(a.nbytes)
    b.write(a)
    b.spill("disk")
    out = np.empty_like(a)
    assert b.readinto(out) == a.nbytes
    assert np.array_equal(out, a)
    half = np.zeros(5000, dtype=np.float64)
    assert b.readinto(half, offset=5000 * 8) == half.nbytes
    assert np.array_equal(half, a[5000:])
    assert b.state == "deferred_disk"
    with pytest.raises(TypeError):
        b.readinto(out[::2])  # not contiguous
    ro = np.zeros(4)
    ro.flags.writeable = False
    with pytest.raises(TypeError):
        b.readinto(ro)
    assert b.state == "deferred_disk"


def test_peek_locked_buffer(rt):
    b = rt.alloc(64)
    b.write(pattern(64, 9))
    with b.lock():
        assert b.peek() == pattern(64, 9)
        out = bytearray(64)
        assert b.readinto(out) == 64 and out == pattern(64, 9)
        assert b.lock_count == 1
    assert b.lock_count == 0


@pytest.mark.parametrize("args, kwargs, exc", [
    ((-1,), {}, ValueError),
    ((65,), {}, ValueError),
    ((1, -1), {}, ValueError),
    ((None, 65), {}, ValueError),
    ((2, 63), {}, ValueError),
    (("x",), {}, TypeError),
    ((1.0,), {}, TypeError),
    ((1, "x"), {}, TypeError),
    ((), {"bogus": 1}, TypeError),
])
def test_peek_bad_arguments(rt, args, kwargs, exc):
    b = rt.alloc(64)
    b.spill("disk")
    with pytest.raises(exc):
        b.peek(*args, **kwargs)
    assert b.state == "deferred_disk"


@pytest.mark.parametrize("make, kwargs, exc", [
    (lambda: b"abcd", {}, TypeError),              # read-only
    (lambda: "abcd", {}, TypeError),
    (lambda: 4, {}, TypeError),
    (lambda: None, {}, TypeError),
    (lambda: bytearray(65), {}, ValueError),       # larger than the buffer
    (lambda: bytearray(2), {"offset": 63}, ValueError),
    (lambda: bytearray(1), {"offset": -1}, ValueError),
    (lambda: bytearray(1), {"offset": "x"}, TypeError),
    (lambda: bytearray(1), {"bogus": 1}, TypeError),
])
def test_readinto_bad_arguments(rt, make, kwargs, exc):
    b = rt.alloc(64)
    b.spill("host")
    with pytest.raises(exc):
        b.readinto(make(), **kwargs)
    assert b.state == "deferred_host"


def test_peek_readinto_freed_is_stale(rt):
    b = rt.alloc(64)
    b.free()
    with pytest.raises(dmem.StaleHandleError):
        b.peek()
    with pytest.raises(dmem.StaleHandleError):
        b.readinto(bytearray(8))


class _KeepController(dmem.Controller):
    def __init__(self):
        self.kept = {}
        self.retrieves = 0

    def store(self, buf, data):
        self.kept[buf.handle] = bytes(data)

    def retrieve(self, buf, out):
        self.retrieves += 1
        out[:] = self.kept[buf.handle]


def test_peek_controller_tier_is_busy(rt):
    c = _KeepController()
    rt.set_controller(c)
    b = rt.alloc(64)
    b.write(pattern(64, 3))
    b.spill("controller")
    with pytest.raises(dmem.BusyError):
        b.peek()
    with pytest.raises(dmem.BusyError):
        b.readinto(bytearray(8))
    assert c.retrieves == 0
    assert b.state == "deferred_controller"
    assert b.read() == pattern(64, 3)
    b.free()
    rt.set_controller(None)


def test_peek_while_other_threads_move(rt):
    import threading
    n = 200_000
    data = pattern(n, 11)
    b = rt.alloc(n)
    b.write(data)
    stop = threading.Event()
    errors = []

    def mover():
        try:
            for i in range(200):
                move = (lambda: b.spill("host"), lambda: b.spill("disk"), b.unspill)[i % 3]
                try:
                    move()
                except (dmem.BusyError, dmem.InvalidArgumentError):
                    pass
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            stop.set()

    t = threading.Thread(target=mover)
    t.start()
    reads = 0
    out = bytearray(n)
    while not stop.is_set() or reads < 20:
        assert b.peek(1000, reads % 5000) == data[reads % 5000:reads % 5000 + 1000]
        assert b.readinto(out) == n and out == data
        reads += 1
    t.join()
    assert not errors, errors
    assert b.read() == data
