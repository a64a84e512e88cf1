"""dmem.Controller: events, victim selection, the controller tier
(store/retrieve), errors raised by callbacks, and callbacks that call back
into the runtime."""

import faulthandler
import gc
import os
import sys
import weakref

import pytest

import dmem

KB = 1 << 10


@pytest.fixture(autouse=True)
def watchdog():
    # A deadlock would hang the suite: dump the stacks and exit instead.
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


class DictController(dmem.Controller):
    """Keeps spilled bytes itself and gives them back."""

    def __init__(self):
        self.stored = {}
        self.events = []

    def on_alloc(self, buf):
        self.events.append(("alloc", buf.handle, buf.size))

    def on_free(self, handle):
        self.events.append(("free", handle))

    def on_spill(self, buf, tier):
        self.events.append(("spill", buf.handle, tier))

    def on_unspill(self, buf):
        self.events.append(("unspill", buf.handle))

    def on_pressure(self, nbytes):
        self.events.append(("pressure", nbytes))

    def store(self, buf, data):
        assert isinstance(data, memoryview) and data.readonly
        assert len(data) == buf.size
        self.stored[buf.handle] = bytes(data)

    def retrieve(self, buf, out):
        assert isinstance(out, memoryview) and not out.readonly
        out[:] = self.stored.pop(buf.handle)


def test_base_class_defaults():
    c = dmem.Controller()
    assert c.select_victims(10) is None
    assert c.on_alloc(None) is None
    with pytest.raises(NotImplementedError):
        c.store(None, b"")
    with pytest.raises(NotImplementedError):
        c.retrieve(None, bytearray())


def test_set_controller_types(rt):
    assert rt.controller is None
    with pytest.raises(TypeError):
        rt.set_controller(42)
    with pytest.raises(TypeError):
        rt.set_controller(object())
    c = dmem.Controller()
    rt.set_controller(c)
    assert rt.controller is c
    rt.set_controller(None)
    assert rt.controller is None
    rt.set_controller(None)


def test_store_without_retrieve_is_invalid(rt):
    class Half(dmem.Controller):
        def store(self, buf, data):
            pass

    with pytest.raises(dmem.InvalidArgumentError):
        rt.set_controller(Half())
    assert rt.controller is None


def test_events(rt):
    c = DictController()
    rt.set_controller(c)
    b = rt.alloc(4 * KB)
    h = b.handle
    b.write(b"e" * (4 * KB))
    b.spill("host")
    b.unspill()
    rt.synchronize()
    b.spill("disk")
    assert b.read(1) == b"e"
    b.free()
    kinds = [e[0] for e in c.events]
    assert c.events[0] == ("alloc", h, 4 * KB)
    assert ("spill", h, "host") in c.events
    assert ("spill", h, "disk") in c.events
    assert kinds.count("unspill") == 2
    assert c.events[-1] == ("free", h)


def test_event_buffers_are_borrowed_wrappers(rt):
    seen = []

    class Keep(dmem.Controller):
        def on_alloc(self, buf):
            seen.append(buf)

    rt.set_controller(Keep())
    b = rt.alloc(64)
    w = seen[0]
    assert w == b and hash(w) == hash(b) and w is not b
    assert "borrowed" in repr(w)
    assert w.size == 64 and w.state == "resident"
    del w, seen[:]
    gc.collect()
    assert b.state == "resident"  # collecting the wrapper freed nothing
    assert rt.stats()["buffer_count"] == 1


def test_pressure_event_on_oom_eviction(rt):
    c = DictController()
    rt.set_controller(c)
    size = rt.stats()["device_capacity"] // 4
    bufs = [rt.alloc(size) for _ in range(6)]
    assert any(e[0] == "pressure" and e[1] > 0 for e in c.events)
    spilled = [e for e in c.events if e[0] == "spill"]
    assert len(spilled) >= 2
    del bufs


def test_controller_tier_roundtrip(rt):
    c = DictController()
    rt.set_controller(c)
    bufs = []
    for i in range(5):
        b = rt.alloc(16 * KB + i)
        b.write(os.urandom(b.size))
        bufs.append((b, b.read()))
    for b, _ in bufs:
        b.spill("controller")
        assert b.state == "deferred_controller"
    assert len(c.stored) == 5
    assert rt.stats()["controller_used"] >= 5 * 16 * KB
    # read() retrieves through the controller
    for b, data in bufs[:3]:
        assert b.read() == data
        assert b.state == "resident"
    assert len(c.stored) == 2
    # lock / unspill retrieve too
    b, data = bufs[3]
    with b.lock():
        pass
    assert b.read() == data
    b, data = bufs[4]
    b.unspill()
    rt.synchronize()
    assert b.read() == data
    assert c.stored == {}
    assert ("spill", bufs[0][0].handle, "controller") in c.events


def test_controller_tier_from_host_tier(rt):
    c = DictController()
    rt.set_controller(c)
    b = rt.alloc(8 * KB)
    b.write(b"h" * (8 * KB))
    b.spill("host")
    b.spill("controller")
    assert b.state == "deferred_controller"
    assert b.read() == b"h" * (8 * KB)


def test_remove_controller_while_holding_bytes_is_busy(rt):
    c = DictController()
    rt.set_controller(c)
    b = rt.alloc(KB)
    b.write(b"1" * KB)
    b.spill("controller")
    with pytest.raises(dmem.BusyError):
        rt.set_controller(None)
    with pytest.raises(dmem.BusyError):
        rt.set_controller(dmem.Controller())  # no store/retrieve: bytes would be lost
    assert rt.controller is c
    assert b.read() == b"1" * KB
    rt.set_controller(None)


def test_free_buffer_in_controller_tier(rt):
    c = DictController()
    rt.set_controller(c)
    b = rt.alloc(KB)
    h = b.handle
    b.spill("controller")
    del b
    assert c.events[-1] == ("free", h)
    assert rt.stats()["controller_used"] == 0


def test_replaced_controller_is_not_called(rt):
    a, b = DictController(), DictController()
    rt.set_controller(a)
    rt.set_controller(b)
    rt.alloc(10)
    assert a.events == [] and len(b.events) >= 1


def test_only_overridden_methods_are_called(rt):
    class OnlyFree(dmem.Controller):
        def __init__(self):
            self.freed = []

        def on_free(self, handle):
            self.freed.append(handle)

    c = OnlyFree()
    rt.set_controller(c)
    x = rt.alloc(10)
    h = x.handle
    x.spill()
    del x
    assert c.freed == [h]


# ---- victim selection -------------------------------------------------------------

def test_select_victims_buffers_and_handles(rt):
    cap = rt.stats()["device_capacity"]
    asked = []
    bufs = [rt.alloc(cap // 4) for _ in range(4)]
    favourite = bufs[2]  # not the LRU one

    class Pick(dmem.Controller):
        def select_victims(self, nbytes):
            asked.append(nbytes)
            return [favourite] if len(asked) == 1 else [bufs[3].handle]

    rt.set_controller(Pick())
    bufs.append(rt.alloc(cap // 4))
    assert asked and asked[0] > 0
    assert favourite.state == "deferred_host"
    assert bufs[0].state == "resident"
    freed = rt.evict(cap // 4)
    assert freed >= cap // 4
    assert bufs[3].state == "deferred_host"


def test_select_victims_none_is_default_policy(rt):
    cap = rt.stats()["device_capacity"]
    calls = []

    class Default(dmem.Controller):
        def select_victims(self, nbytes):
            calls.append(nbytes)
            return None

    rt.set_controller(Default())
    bufs = [rt.alloc(cap // 4) for _ in range(5)]
    assert calls
    assert bufs[0].state == "deferred_host"  # LRU


def test_select_victims_skips_locked_and_pinned(rt):
    cap = rt.stats()["device_capacity"]
    a = rt.alloc(cap // 4, pinned=True)
    b = rt.alloc(cap // 4)
    c = rt.alloc(cap // 4)

    class Bad(dmem.Controller):
        def select_victims(self, nbytes):
            return [a, b]

    rt.set_controller(Bad())
    with b.lock():
        freed = rt.evict(cap // 4)
    assert freed >= cap // 4
    assert a.state == "resident" and b.state == "resident"
    assert c.state == "deferred_host"  # the default policy freed the rest


@pytest.mark.parametrize("result, cause", [
    (5, TypeError),
    (["nope"], TypeError),
    ([1.5], TypeError),
    ([-1], ValueError),
])
def test_select_victims_bad_result(rt, result, cause):
    rt.alloc(KB)

    class Bad(dmem.Controller):
        def select_victims(self, nbytes):
            return result

    rt.set_controller(Bad())
    with pytest.raises(dmem.CallbackError) as ei:
        rt.evict(KB)
    assert isinstance(ei.value.__cause__, cause)


def test_select_victims_buffer_of_other_runtime(rt):
    rt.alloc(KB)
    with dmem.Runtime(backend="host", host_capacity=1 << 20) as other:
        ob = other.alloc(10)

        class Bad(dmem.Controller):
            def select_victims(self, nbytes):
                return [ob]

        rt.set_controller(Bad())
        with pytest.raises(dmem.CallbackError) as ei:
            rt.evict(KB)
        assert isinstance(ei.value.__cause__, ValueError)
        rt.set_controller(None)


# ---- callbacks that raise ------------------------------------------------------------

class Boom(Exception):
    pass


def test_raising_on_alloc_fails_alloc_and_frees(rt):
    class C(dmem.Controller):
        def on_alloc(self, buf):
            raise Boom("no allocs today")

    rt.set_controller(C())
    with pytest.raises(dmem.CallbackError) as ei:
        rt.alloc(100)
    e = ei.value
    assert isinstance(e.__cause__, Boom) and str(e.__cause__) == "no allocs today"
    assert e.__cause__.__traceback__ is not None
    assert e.status == dmem.CallbackError.status == -20
    assert "Boom" in str(e)
    assert rt.stats()["buffer_count"] == 0


def test_raising_on_spill_surfaces_in_spill(rt):
    class C(dmem.Controller):
        def on_spill(self, buf, tier):
            raise Boom(tier)

    b = rt.alloc(100)
    b.write(b"x" * 100)
    rt.set_controller(C())
    with pytest.raises(dmem.CallbackError) as ei:
        b.spill("disk")
    assert isinstance(ei.value.__cause__, Boom)
    assert str(ei.value.__cause__) == "disk"
    assert b.state == "deferred_disk"  # a notification cannot undo the move
    rt.set_controller(None)
    assert b.read() == b"x" * 100


def test_raising_store_keeps_buffer_intact(rt):
    class C(DictController):
        def store(self, buf, data):
            raise Boom("disk full")

    rt.set_controller(C())
    b = rt.alloc(4 * KB)
    b.write(b"i" * (4 * KB))
    with pytest.raises(dmem.CallbackError) as ei:
        b.spill("controller")
    assert isinstance(ei.value.__cause__, Boom)
    assert b.state == "resident"
    assert b.read() == b"i" * (4 * KB)


def test_raising_retrieve_keeps_buffer_in_controller_tier(rt):
    class C(DictController):
        fail = True

        def retrieve(self, buf, out):
            if self.fail:
                raise Boom("not now")
            super().retrieve(buf, out)

    c = C()
    rt.set_controller(c)
    b = rt.alloc(4 * KB)
    b.write(b"r" * (4 * KB))
    b.spill("controller")
    with pytest.raises(dmem.CallbackError) as ei:
        b.read()
    assert isinstance(ei.value.__cause__, Boom)
    assert b.state == "deferred_controller"
    with pytest.raises(dmem.CallbackError):
        with b.lock():
            pass
    assert b.lock_count == 0
    c.fail = False
    assert b.read() == b"r" * (4 * KB)


def test_store_keeping_the_memoryview_is_refused(rt):
    class Lazy(DictController):
        def store(self, buf, data):
            self.stored[buf.handle] = data  # no copy: a bug

    rt.set_controller(Lazy())
    b = rt.alloc(KB)
    b.write(b"L" * KB)
    with pytest.raises(dmem.CallbackError) as ei:
        b.spill("controller")
    assert isinstance(ei.value.__cause__, BufferError)
    assert b.state == "resident" and b.read() == b"L" * KB


def test_store_keeping_numpy_view_is_refused(rt):
    np = pytest.importorskip("numpy")

    class Lazy(DictController):
        def store(self, buf, data):
            self.stored[buf.handle] = np.frombuffer(data, dtype=np.uint8)

    rt.set_controller(Lazy())
    b = rt.alloc(KB)
    with pytest.raises(dmem.CallbackError) as ei:
        b.spill("controller")
    assert isinstance(ei.value.__cause__, BufferError)
    assert b.state == "resident"


def test_raising_select_victims(rt):
    class C(dmem.Controller):
        def select_victims(self, nbytes):
            raise Boom("undecided")

    bufs = [rt.alloc(KB) for _ in range(3)]
    rt.set_controller(C())
    with pytest.raises(dmem.CallbackError) as ei:
        rt.evict(KB)
    assert isinstance(ei.value.__cause__, Boom)
    assert all(b.state == "resident" for b in bufs)  # nothing spilled by it


def test_raising_on_free_during_collection_goes_to_unraisablehook(rt, monkeypatch):
    got = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: got.append(u.exc_value))

    class C(dmem.Controller):
        def on_free(self, handle):
            raise Boom(handle)

    rt.set_controller(C())
    b = rt.alloc(10)
    h = b.handle
    del b  # no Python call to raise in
    assert len(got) == 1 and isinstance(got[0], Boom) and got[0].args == (h,)
    assert rt.stats()["buffer_count"] == 0


def test_raising_on_free_in_explicit_free(rt):
    class C(dmem.Controller):
        def on_free(self, handle):
            raise Boom(handle)

    rt.set_controller(C())
    b = rt.alloc(10)
    with pytest.raises(dmem.CallbackError) as ei:
        b.free()
    assert isinstance(ei.value.__cause__, Boom)
    with pytest.raises(dmem.StaleHandleError):
        b.read()  # it was freed all the same


def test_only_first_callback_exception_raises_rest_unraisable(rt, monkeypatch):
    got = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: got.append(u.exc_value))
    n = [0]

    class C(dmem.Controller):
        def on_spill(self, buf, tier):
            n[0] += 1
            raise Boom(n[0])

    bufs = [rt.alloc(KB) for _ in range(3)]
    rt.set_controller(C())
    with pytest.raises(dmem.CallbackError) as ei:
        rt.evict(3 * KB)
    assert ei.value.__cause__.args == (1,)
    assert [e.args for e in got] == [(i,) for i in range(2, n[0] + 1)]
    del bufs


def test_callback_error_does_not_leak_into_next_call(rt):
    class C(dmem.Controller):
        armed = True

        def on_alloc(self, buf):
            if self.armed:
                self.armed = False
                raise Boom()

    rt.set_controller(C())
    with pytest.raises(dmem.CallbackError):
        rt.alloc(10)
    b = rt.alloc(10)  # next call is clean
    assert b.state == "resident"


# ---- callbacks calling back into the runtime ----------------------------------------

def test_callbacks_reenter_runtime(rt):
    cap = rt.stats()["device_capacity"]
    log = []
    spare = rt.alloc(KB)
    spare.write(b"s" * KB)

    class Reentrant(DictController):
        def on_alloc(self, buf):
            log.append(("alloc", buf.state, rt.stats()["buffer_count"]))

        def on_spill(self, buf, tier):
            log.append(("spill", buf.state, tier, buf.lock_count))

        def on_pressure(self, nbytes):
            # spill something ourselves, from inside the allocation
            if spare.state == "resident":
                spare.spill("host")
            log.append(("pressure", nbytes))

        def select_victims(self, nbytes):
            log.append(("select", nbytes, rt.stats()["device_used"]))
            return None

        def store(self, buf, data):
            log.append(("store", spare.read(2), rt.stats()["buffer_count"]))
            super().store(buf, data)

        def retrieve(self, buf, out):
            tmp = rt.alloc(16)  # allocate and free from inside a retrieve
            tmp.write(b"t" * 16)
            assert tmp.read() == b"t" * 16
            tmp.free()
            super().retrieve(buf, out)

    rt.set_controller(Reentrant())
    bufs = [rt.alloc(cap // 4) for _ in range(6)]
    assert any(e[0] == "pressure" for e in log)
    assert any(e[0] == "select" for e in log)
    assert spare.state != "resident" or any(e[0] == "spill" for e in log)
    c = rt.alloc(2 * KB)
    c.write(b"c" * (2 * KB))
    c.spill("controller")
    assert c.read() == b"c" * (2 * KB)
    assert any(e[0] == "store" and e[1] == b"ss" for e in log)
    del bufs


def _enter_lock(buf):
    buf.lock().__enter__()  # dropped at once: the view's collection unlocks


@pytest.mark.parametrize("start", ["resident", "deferred_host"])
@pytest.mark.parametrize("op", ["spill", "lock", "unspill"])
def test_store_may_not_move_its_own_buffer(rt, start, op):
    # controller.h: store and retrieve must not lock, spill or unspill the
    # buffer they were called for - that returns DMEM_ERR_BUSY.
    results = []
    ops = {"spill": lambda b: b.spill("disk"), "lock": _enter_lock,
           "unspill": lambda b: b.unspill()}

    class Self(DictController):
        def store(self, buf, data):
            try:
                ops[op](buf)
                results.append("ok")
            except dmem.BusyError:
                results.append("busy")
            super().store(buf, data)

    rt.set_controller(Self())
    b = rt.alloc(KB)
    b.write(b"o" * KB)
    if start != "resident":
        b.spill("host")
    try:
        b.spill("controller")
    except dmem.BusyError:
        pass
    assert results == ["busy"]
    assert b.state == "deferred_controller"
    assert b.read() == b"o" * KB


def test_retrieve_may_not_move_its_own_buffer(rt):
    results = []

    class Self(DictController):
        def retrieve(self, buf, out):
            for op in (lambda: buf.spill("disk"), lambda: _enter_lock(buf),
                       lambda: buf.unspill()):
                try:
                    op()
                    results.append("ok")
                except dmem.BusyError:
                    results.append("busy")
            super().retrieve(buf, out)

    rt.set_controller(Self())
    b = rt.alloc(KB)
    b.write(b"o" * KB)
    b.spill("controller")
    assert b.read() == b"o" * KB
    assert results == ["busy", "busy", "busy"]


def test_callback_closing_runtime_is_refused(rt):
    errors = []

    class Closer(dmem.Controller):
        def on_alloc(self, buf):
            try:
                rt.close()
            except dmem.BusyError as e:
                errors.append(e)

    rt.set_controller(Closer())
    b = rt.alloc(10)
    assert len(errors) == 1 and not rt.closed
    assert b.state == "resident"


def test_callback_frees_the_buffer_it_sees(rt):
    class Freer(dmem.Controller):
        def on_spill(self, buf, tier):
            buf.free()

    rt.set_controller(Freer())
    b = rt.alloc(KB)
    b.spill("host")
    with pytest.raises(dmem.StaleHandleError):
        b.read()
    assert rt.stats()["buffer_count"] == 0


# ---- lifetime --------------------------------------------------------------------------

def test_controller_referencing_runtime_is_collected():
    r = dmem.Runtime(backend="host", host_capacity=1 << 20)

    class Cyclic(DictController):
        def __init__(self, runtime):
            super().__init__()
            self.rt = runtime

    c = Cyclic(r)
    r.set_controller(c)
    b = r.alloc(KB)
    b.spill("controller")
    c.keep = b  # runtime -> controller -> buffer -> runtime
    wr, wc = weakref.ref(r), weakref.ref(c)
    del r, c, b
    gc.collect()
    assert wr() is None and wc() is None


def test_close_with_bytes_in_controller_tier():
    r = dmem.Runtime(backend="host", host_capacity=1 << 20)
    c = DictController()
    r.set_controller(c)
    b = r.alloc(KB)
    b.spill("controller")
    r.close()
    with pytest.raises(dmem.StaleHandleError):
        b.read()
    assert r.controller is None


# ---- issue 22: store may return its data, on_free at close, on_unspill's tier ----


def test_store_may_return_the_data_it_was_given(rt):
    """What store/retrieve return is dropped: returning data (or out, or a
    view of it) is not keeping it."""

    class Returns(DictController):
        def store(self, buf, data):
            super().store(buf, data)
            return data

        def retrieve(self, buf, out):
            super().retrieve(buf, out)
            return out[:4]

    c = Returns()
    rt.set_controller(c)
    b = rt.alloc(4 * KB)
    b.write(b"r" * (4 * KB))
    b.spill("controller")
    assert b.state == "deferred_controller"
    assert b.read() == b"r" * (4 * KB)
    b.free()
    rt.set_controller(None)


def test_store_that_keeps_its_data_is_still_refused(rt):
    kept = []

    class Keeps(DictController):
        def store(self, buf, data):
            kept.append(data)
            return data

    rt.set_controller(Keeps())
    b = rt.alloc(4 * KB)
    with pytest.raises(dmem.CallbackError) as ei:
        b.spill("controller")
    assert isinstance(ei.value.__cause__, BufferError)
    assert b.state == "resident"
    b.free()
    rt.set_controller(None)


def test_on_free_for_every_buffer_alive_when_the_runtime_closes(spill_dir):
    r = dmem.Runtime(backend="host", host_capacity=1 << 20, spill_dir=str(spill_dir))
    c = DictController()
    r.set_controller(c)
    held = r.alloc(4 * KB)
    held.write(b"h" * (4 * KB))
    held.spill("controller")
    other = r.alloc(8 * KB)
    gone = r.alloc(KB)
    handles = {held.handle, other.handle}
    gone_h = gone.handle
    gone.free()
    assert held.handle in c.stored
    c.events.clear()
    r.close()
    freed = [e[1] for e in c.events if e[0] == "free"]
    assert sorted(freed) == sorted(handles)  # each once; not the one freed before
    assert gone_h not in freed
    assert [e for e in c.events if e[0] != "free"] == []  # nothing else at close


def test_on_unspill_receives_the_source_tier(rt):
    seen = []

    class Tiers(DictController):
        def on_unspill(self, buf, tier):
            seen.append((buf.handle, tier))

    rt.set_controller(Tiers())
    b = rt.alloc(4 * KB)
    b.write(b"t" * (4 * KB))
    for tier in ("host", "disk", "controller"):
        b.spill(tier)
        assert b.read(1) == b"t"  # brings it back
        rt.synchronize()
    assert seen == [(b.handle, "host"), (b.handle, "disk"), (b.handle, "controller")]
    b.free()
    rt.set_controller(None)


def test_on_unspill_of_one_argument_is_still_called(rt):
    c = DictController()  # on_unspill(self, buf)
    rt.set_controller(c)
    b = rt.alloc(4 * KB)
    b.spill("host")
    b.unspill()
    rt.synchronize()
    assert ("unspill", b.handle) in c.events
    b.free()
    rt.set_controller(None)
