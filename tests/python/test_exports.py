"""Exports of a lock view keep the buffer locked for exactly as long as they
live (issue 12, item 0): the buffer protocol (memoryview, numpy.asarray), the
array interface (the View itself is the export: arrays keep it as their base)
and DLPack (capsules and the tensors made from them, released by the DLPack
deleter). The end of the ``with`` block releases only the block's claim.
Host backend, NumPy."""

import gc
import sys
import threading
import tracemalloc
import weakref

import pytest

import dmem

np = pytest.importorskip("numpy")

MB = 1 << 20


def exports(rt):
    s = rt.stats()
    return s["exposed"], s["exports"]


def assert_unexposed(rt, *bufs):
    exposed, by_kind = exports(rt)
    assert exposed == 0
    assert by_kind == {"buffer": 0, "array_interface": 0, "dlpack": 0}
    for b in bufs:
        assert not b.exposed
        assert b.lock_count == 0


# ---- the issue's example ---------------------------------------------------------

def test_issue_example_array_outliving_the_block(rt):
    b = rt.alloc(MB)
    b.write(b"\x01" * MB)
    with b.lock() as v:
        a = np.asarray(v)  # a outlives the block
    assert not v.locked
    with pytest.raises(dmem.NotLockedError):
        v.ptr  # the view's own addresses end with the block
    assert b.exposed and b.lock_count == 1 and b.state == "resident"
    with pytest.raises(dmem.BusyError) as ei:
        b.spill("host")
    assert "buffer-protocol" in str(ei.value) and "numpy" in str(ei.value)
    assert b.state == "resident"
    c = rt.alloc(MB)
    c.write(b"\x02" * MB)
    a[:16] = 7  # still b's memory: no crash, no corruption of c
    assert c.read() == b"\x02" * MB
    assert b.read(17) == b"\x07" * 16 + b"\x01"
    assert exports(rt) == (1, {"buffer": 1, "array_interface": 0, "dlpack": 0})
    del a
    assert_unexposed(rt, b)
    b.spill("host")
    assert b.state == "deferred_host"
    assert b.read(17) == b"\x07" * 16 + b"\x01"
    assert c.read() == b"\x02" * MB


def test_block_end_releases_only_its_own_claim(rt):
    b = rt.alloc(4096)
    with b.lock() as v:
        assert b.lock_count == 1 and not b.exposed
        a = np.asarray(v)
        assert b.exposed and b.lock_count == 1  # one dmem lock per view
        assert v.exports == {"buffer": 1, "array_interface": 0, "dlpack": 0}
    assert b.lock_count == 1
    assert "held by its exports" in repr(v)
    with pytest.raises(dmem.NotLockedError):
        memoryview(v)  # no new exports after the block
    del a
    assert b.lock_count == 0
    assert "released" in repr(v)
    # a block with no exports unlocks at its end, as before
    with b.lock():
        pass
    assert b.lock_count == 0


def test_memoryview_release_unlocks_at_once(rt):
    b = rt.alloc(256)
    b.write(bytes(range(256)))
    with b.lock() as v:
        m = memoryview(v)
        assert m.nbytes == 256 and not m.readonly and m.format == "B"
    assert m[5] == 5
    m[0] = 0xEE
    m.release()  # no collection needed
    assert_unexposed(rt, b)
    b.spill("disk")
    assert b.read(2) == b"\xee\x01"


def test_bytes_of_a_view_takes_and_drops_a_claim(rt):
    b = rt.alloc(64)
    b.write(b"z" * 64)
    with b.lock() as v:
        assert bytes(v) == b"z" * 64
        assert not b.exposed and b.lock_count == 1
    assert_unexposed(rt, b)


# ---- the array interface: the View is the export -----------------------------------

class Consumer:
    """Like a library that builds its array from __array_interface__ and keeps
    the object that provided it (here the view) as the array's base."""

    def __init__(self, view):
        self.view = view

    @property
    def __array_interface__(self):
        return self.view.__array_interface__


def test_array_interface_export_lives_with_the_view(rt):
    b = rt.alloc(4096)
    b.write(b"\x05" * 4096)
    with b.lock() as v:
        a = np.asarray(Consumer(v))  # NumPy keeps the Consumer, which keeps v
        assert a.ctypes.data == v.ptr
        assert v.exports["array_interface"] == 1
        v.__array_interface__  # counted once per view
        assert v.exports["array_interface"] == 1
    del v  # only the array holds the view now
    assert b.exposed
    with pytest.raises(dmem.BusyError) as ei:
        b.spill("disk")
    assert "array-interface" in str(ei.value)
    a[:] = 9
    del a
    assert_unexposed(rt, b)
    b.spill("disk")
    assert b.read() == b"\x09" * 4096


def test_array_interface_taken_keeps_lock_until_view_dies(rt):
    b = rt.alloc(64)
    with b.lock() as v:
        ai = v.__array_interface__
    assert ai["data"][0] != 0
    assert b.exposed  # whoever took the dict may still use its address
    with pytest.raises(dmem.BusyError):
        b.spill()
    del v
    assert_unexposed(rt, b)
    b.spill()


# ---- DLPack ------------------------------------------------------------------------------

def test_unconsumed_capsules_hold_until_collected(rt):
    b = rt.alloc(64)
    with b.lock() as v:
        caps = [v.__dlpack__(), v.__dlpack__(max_version=(1, 0))]
        assert v.exports["dlpack"] == 2
    del v  # the capsules keep the view alive
    with pytest.raises(dmem.BusyError) as ei:
        b.spill()
    assert "2 DLPack exports" in str(ei.value)
    assert exports(rt) == (1, {"buffer": 0, "array_interface": 0, "dlpack": 2})
    caps.pop()
    assert b.exposed
    caps.pop()
    assert_unexposed(rt, b)
    b.spill()


def test_numpy_from_dlpack_tensor_keeps_locked(rt):
    if not hasattr(np, "from_dlpack"):
        pytest.skip("numpy without from_dlpack")
    b = rt.alloc(MB)
    b.write(b"\x03" * MB)
    b.spill("disk")
    with b.lock() as v:
        t = np.from_dlpack(v)
        assert t.ctypes.data == v.ptr
    assert v.exports["dlpack"] == 1
    with pytest.raises(dmem.BusyError) as ei:
        b.spill("host")
    assert "DLPack" in str(ei.value)
    t += 1
    u = t[10:20]  # a slice keeps the tensor (and the lock) alive too
    del t
    assert b.exposed
    del u
    assert_unexposed(rt, b)
    b.spill("host")
    b.unspill()
    rt.synchronize()
    assert b.read() == b"\x04" * MB


def test_dlpack_deleter_on_another_thread(rt):
    if not hasattr(np, "from_dlpack"):
        pytest.skip("numpy without from_dlpack")
    b = rt.alloc(4096)
    with b.lock() as v:
        box = [np.from_dlpack(v), v.__dlpack__()]
    del v
    assert b.exposed
    th = threading.Thread(target=box.clear)  # the deleters run on that thread
    th.start()
    th.join()
    assert_unexposed(rt, b)
    b.spill("host")


def test_every_kind_named_and_counted(rt):
    b = rt.alloc(1024)
    other = rt.alloc(1024)
    with b.lock() as v1, b.lock() as v2, other.lock() as v3:
        m1, m2 = memoryview(v1), memoryview(v2)
        cap = v2.__dlpack__()
        v1.__array_interface__
        m3 = memoryview(v3)
        assert b.lock_count == 2
    assert exports(rt) == (2, {"buffer": 3, "array_interface": 1, "dlpack": 1})
    with pytest.raises(dmem.BusyError) as ei:
        b.spill()
    msg = str(ei.value)
    assert "2 numpy/buffer-protocol exports" in msg
    assert "1 array-interface export" in msg
    assert "1 DLPack export" in msg
    del m1, m2, cap
    assert b.exposed  # v1's array interface: v1 is still bound
    del v1
    assert not b.exposed and b.lock_count == 0
    assert other.exposed
    del m3
    assert_unexposed(rt, b, other)
    del v2, v3


# ---- free, close, streams -----------------------------------------------------------------

def test_free_of_exposed_buffer_is_deferred(rt):
    b = rt.alloc(MB)
    b.write(b"\x01" * MB)
    used0 = rt.stats()["device_used"]
    with b.lock() as v:
        a = np.asarray(v)
    del v
    b.free()  # the handle is stale at once, the memory stays a's
    with pytest.raises(dmem.StaleHandleError):
        b.read(1)
    assert b.exposed
    c = rt.alloc(MB)  # must not get b's memory
    c.write(b"\x02" * MB)
    assert (a == 1).all()
    a[:] = 3
    assert c.read() == b"\x02" * MB
    del a  # now the memory is reclaimed
    assert not b.exposed
    assert rt.stats()["device_used"] == used0  # b's bytes gone, c's in
    assert rt.stats()["buffer_count"] == 1


def test_close_refused_while_exported(spill_dir):
    r = dmem.Runtime(backend="host", host_capacity=4 * MB, spill_dir=str(spill_dir))
    b = r.alloc(4096)
    b.write(b"q" * 4096)
    with b.lock() as v:
        a = np.asarray(v)
    with pytest.raises(dmem.BusyError) as ei:
        r.close()
    assert "Runtime.close()" in str(ei.value) and "buffer-protocol" in str(ei.value)
    assert not r.closed
    assert bytes(a[:4]) == b"qqqq" and b.read(4) == b"qqqq"
    del a
    r.close()
    assert r.closed
    del v


def test_stream_close_refused_while_exported(rt):
    b = rt.alloc(4096)
    s = rt.stream()
    with b.lock(s) as v:
        a = np.asarray(v)
    with pytest.raises(dmem.BusyError):
        s.close()
    del a
    s.close()
    del v


def test_exception_in_block_with_export(rt):
    b = rt.alloc(64)

    def body():
        with b.lock() as v:
            a = np.asarray(v)  # noqa: F841 - dropped with the frame
            raise KeyError("inside")

    with pytest.raises(KeyError):
        body()
    # the traceback (held by pytest.raises' ExceptionInfo) keeps the frame
    gc.collect()
    sys.last_traceback = None
    del body
    gc.collect()
    assert_unexposed(rt, b)


# ---- no leaks, garbage-collected cycles --------------------------------------------------

def _cycle(rt, b, n):
    for i in range(n):
        with b.lock() as v:
            a = np.asarray(v)
            t = np.from_dlpack(v)
            m = memoryview(v)
            cap = v.__dlpack__(max_version=(1, 0))
        a[i % 64] = i & 0xFF
        del a, t, m, cap, v
        if i % 16 == 0:
            b.spill("host" if i % 32 else "disk")


def test_many_cycles_leak_nothing(rt):
    b = rt.alloc(4096)
    b.write(bytes(4096))
    _cycle(rt, b, 50)  # warm up caches
    gc.collect()
    refs = sys.getrefcount(b), sys.getrefcount(rt)
    tracemalloc.start()
    try:
        snap0 = tracemalloc.take_snapshot()
        _cycle(rt, b, 1000)
        gc.collect()
        snap1 = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = sum(s.size_diff for s in snap1.compare_to(snap0, "filename"))
    assert grown < 64 << 10, f"{grown} bytes still allocated after 1000 cycles"
    assert (sys.getrefcount(b), sys.getrefcount(rt)) == refs
    assert_unexposed(rt, b)
    b.spill("disk")
    expected = bytearray(4096)
    for i in range(1000):  # the second run wrote all 64 bytes last
        expected[i % 64] = i & 0xFF
    assert b.read() == bytes(expected)


def test_cycles_with_exports_are_collected(rt):
    b = rt.alloc(4096)
    gc.collect()
    gc.disable()
    try:
        class Node:
            pass

        with b.lock() as v:
            n = Node()
            n.self = n  # a cycle holding an array, a capsule and a memoryview
            n.arr = np.asarray(v)
            n.cap = v.__dlpack__()
            n.mv = memoryview(v)
            n.view = v  # and the view itself (array interface taken)
            v.__array_interface__
        del n, v
        assert b.exposed  # only the cycle holds them
        with pytest.raises(dmem.BusyError):
            b.spill()
    finally:
        gc.enable()
    gc.collect()
    assert_unexposed(rt, b)
    b.spill()


def test_cycle_through_view_and_runtime_is_collected(spill_dir):
    # runtime -> controller -> memoryview -> View -> Buffer -> runtime: only
    # collectable because the View takes part in the cyclic GC.
    r = dmem.Runtime(backend="host", host_capacity=4 * MB, spill_dir=str(spill_dir))
    ctrl = dmem.Controller()
    r.set_controller(ctrl)
    b = r.alloc(4096)
    with b.lock() as v:
        ctrl.keep = memoryview(v)
    assert b.exposed
    wr = weakref.ref(r)
    del r, ctrl, b, v
    gc.collect()
    assert wr() is None  # collected (and closed) without a crash


def test_exit_with_live_export_keeps_memory_valid(tmp_path):
    # An atexit function registered before dmem's runs after dmem's shutdown
    # hook: the runtime it would close still has an export, so it is left
    # open and the array stays readable until the process ends.
    from conftest import run_python

    (tmp_path / "r").mkdir()
    (tmp_path / "o").mkdir()
    code = f"""
        import atexit
        def late():
            print("late", bytes(a[:3]), int(a.sum()), flush=True)
        atexit.register(late)
        import dmem, numpy
        rt = dmem.Runtime(backend="host", host_capacity=1 << 20,
                          spill_dir={str(tmp_path / "r")!r})
        other = dmem.Runtime(backend="host", host_capacity=1 << 20,
                             spill_dir={str(tmp_path / "o")!r})
        b = rt.alloc(4096)
        b.write(b"x" * 4096)
        with b.lock() as v:
            a = numpy.asarray(v)
        keep = [r.alloc(64) for r in (rt, other)]
        for k in keep:
            k.spill("disk")  # both make their private spill directory
        print("ok", flush=True)
    """
    p = run_python(code)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[:2] == ["ok", "late b'xxx' %d" % (ord("x") * 4096)]
    assert "Traceback" not in p.stderr
    # the runtime without exports was closed at exit, its directory removed
    # (the other one is destroyed, if at all, when finalisation collects it)
    assert list((tmp_path / "o").iterdir()) == []


def test_close_collects_exports_held_by_garbage_cycles(spill_dir):
    # A frame that raised holds its view through the traceback, which the
    # exception (kept in the frame) holds back: a garbage cycle. close()
    # collects it instead of refusing.
    r = dmem.Runtime(backend="host", host_capacity=4 * MB, spill_dir=str(spill_dir))
    b = r.alloc(64)

    def use():
        with b.lock() as v:
            v.__array_interface__  # the view becomes an export
        try:
            v.ptr
        except dmem.NotLockedError as e:
            err = e  # noqa: F841 - err -> traceback -> this frame -> err
    thresholds = gc.get_threshold()
    gc.collect()
    gc.set_threshold(1 << 30)  # enabled, but no automatic collection meanwhile
    try:
        use()
        assert b.exposed  # only the garbage cycle holds the view
        del b
        r.close()
    finally:
        gc.set_threshold(*thresholds)
    assert r.closed


def test_exports_from_many_threads(rt):
    # Threads make and drop exports of the same buffers (the runtime's list
    # of exposed views is shared) while another spills them: every spill of
    # an exposed buffer is refused, none corrupts, and all ends unexposed.
    bufs = [rt.alloc(4096) for _ in range(3)]
    for i, b in enumerate(bufs):
        b.write(bytes([i]) * 4096)
    stop = threading.Event()
    errors = []

    def user(k):
        try:
            for n in range(300):
                b = bufs[(k + n) % len(bufs)]
                with b.lock() as v:
                    keep = [np.asarray(v), np.from_dlpack(v), memoryview(v)]
                assert b.exposed
                assert keep[n % 3][0] == (k + n) % len(bufs)
                del keep, v
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def spiller():
        n = 0
        try:
            while not stop.is_set():
                b = bufs[n % len(bufs)]
                # Only this thread moves buffers down, so a buffer seen
                # resident is resident or locked at the spill: on disk, it
                # may only go to disk ("host" is refused: unspill first).
                tier = "host" if n % 2 and b.state == "resident" else "disk"
                try:
                    b.spill(tier)
                except dmem.BusyError:
                    pass
                n += 1
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=user, args=(k,)) for k in range(3)]
    sp = threading.Thread(target=spiller)
    sp.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    sp.join()
    assert errors == []
    assert_unexposed(rt, *bufs)
    for i, b in enumerate(bufs):
        assert b.read() == bytes([i]) * 4096
