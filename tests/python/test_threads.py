"""Many Python threads allocating, locking, spilling and reading at once,
with and without a controller; close() racing with work on other threads."""

import ctypes
import faulthandler
import os
import random
import threading
import time

import pytest

import dmem

KB = 1 << 10
THREADS = 8


def spill(buf, tier):
    """Spill, tolerating what concurrency makes legitimate: another thread
    holds a lock or is moving the buffer (BusyError), or already moved it
    further than `tier` (disk/controller -> host is not a move)."""
    try:
        buf.spill(tier)
    except dmem.BusyError:
        pass
    except dmem.InvalidArgumentError as e:
        if "cannot move" not in e.detail:
            raise


@pytest.fixture(autouse=True)
def watchdog():
    faulthandler.dump_traceback_later(240, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def run_threads(target, n=THREADS):
    errors = []
    barrier = threading.Barrier(n)

    def wrap(i):
        try:
            barrier.wait()
            target(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((i, e))

    threads = [threading.Thread(target=wrap, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=200)
    assert not any(t.is_alive() for t in threads), "threads hung"
    assert errors == [], errors


def worker_ops(rt, i, iterations=150, tiers=("host", "disk")):
    rng = random.Random(i)
    mine = []
    for it in range(iterations):
        size = rng.choice([KB, 16 * KB, 64 * KB, 200 * KB])
        b = rt.alloc(size, priority=rng.randint(-1, 1))
        tag = bytes([(i * 37 + it) & 0xFF]) * 64
        b.write(tag)
        mine.append((b, tag))
        op = rng.randrange(5)
        victim, vtag = rng.choice(mine)
        try:
            if op == 0:
                spill(victim, rng.choice(tiers))
            elif op == 1:
                with victim.lock() as v:
                    assert ctypes.string_at(v.ptr, 64) == vtag
            elif op == 2:
                assert victim.read(64) == vtag
            elif op == 3:
                rt.lock_and_launch([victim], lambda s, p: None)
            else:
                victim.unspill()
        except dmem.BusyError:
            pass  # another thread is moving it or holds a lock: allowed
        if len(mine) > 12:
            b, tag = mine.pop(rng.randrange(len(mine)))
            assert b.read(64) == tag
            if rng.random() < 0.5:
                b.free()
    for b, tag in mine:
        assert b.read(64) == tag


def test_threads_alloc_lock_spill(spill_dir):
    with dmem.Runtime(backend="host", host_capacity=4 << 20, spill_dir=spill_dir) as rt:
        run_threads(lambda i: worker_ops(rt, i))
        s = rt.stats()
        assert s["spill_count"] > 0 and s["oom_evictions"] > 0
        assert s["device_used"] <= 4 << 20


def test_threads_share_buffers(rt):
    shared = [rt.alloc(32 * KB) for _ in range(16)]
    for k, b in enumerate(shared):
        b.write(bytes([k]) * 32 * KB)

    def work(i):
        rng = random.Random(100 + i)
        for _ in range(300):
            k = rng.randrange(len(shared))
            b = shared[k]
            op = rng.randrange(4)
            try:
                if op == 0:
                    spill(b, rng.choice(["host", "disk"]))
                elif op == 1:
                    assert b.read(16, rng.randrange(32 * KB - 16)) == bytes([k]) * 16
                elif op == 2:
                    with b.lock() as v:
                        assert ctypes.string_at(v.ptr + 100, 8) == bytes([k]) * 8
                else:
                    rt.evict(64 * KB)
            except dmem.BusyError:
                pass

    run_threads(work)
    for k, b in enumerate(shared):
        assert b.read() == bytes([k]) * 32 * KB
        assert b.lock_count == 0


def test_threads_with_controller(rt):
    lock = threading.Lock()

    class Ctrl(dmem.Controller):
        def __init__(self):
            self.stored = {}
            self.allocs = 0
            self.frees = 0

        def on_alloc(self, buf):
            with lock:
                self.allocs += 1

        def on_free(self, handle):
            with lock:
                self.frees += 1

        def store(self, buf, data):
            with lock:
                self.stored[buf.handle] = bytes(data)

        def retrieve(self, buf, out):
            with lock:
                out[:] = self.stored.pop(buf.handle)

    c = Ctrl()
    rt.set_controller(c)
    run_threads(lambda i: worker_ops(rt, i, iterations=100, tiers=("host", "disk", "controller")))
    assert c.allocs == THREADS * 100
    assert c.frees == c.allocs - rt.stats()["buffer_count"]


def test_threads_launch_async_streams(rt):
    def work(i):
        s = rt.stream()
        bufs = [rt.alloc(8 * KB) for _ in range(4)]
        for _ in range(100):
            got = rt.launch_async(s, bufs, lambda st, p: (st, len(p)))
            assert got == (int(s), 4)
            if i % 2:
                rt.sync_and_unlock(s)
            else:
                rt.stream_release(s)
                s.synchronize()
                rt.poll()
        rt.sync_and_unlock(s)
        assert all(b.lock_count == 0 for b in bufs)
        s.close()

    run_threads(work)


def test_threads_callback_errors_stay_on_their_thread(rt):
    class Picky(dmem.Controller):
        def on_alloc(self, buf):
            if buf.size % 2:
                raise ValueError(buf.size)

    rt.set_controller(Picky())

    def work(i):
        for k in range(200):
            size = 2 * (i * 1000 + k) + 2
            b = rt.alloc(size)  # even: must never see another thread's error
            with pytest.raises(dmem.CallbackError) as ei:
                rt.alloc(size + 1)
            assert ei.value.__cause__.args == (size + 1,)
            b.free()

    run_threads(work)
    assert rt.stats()["buffer_count"] == 0


def test_close_while_other_threads_work(spill_dir):
    rt = dmem.Runtime(backend="host", host_capacity=4 << 20, spill_dir=spill_dir)
    started = threading.Event()
    stop = threading.Event()
    errors = []

    def work(i):
        try:
            keep = []
            while not stop.is_set():
                try:
                    b = rt.alloc(64 * KB)
                    b.write(b"w" * 64)
                    keep.append(b)
                    if len(keep) > 20:
                        spill(keep.pop(0), "disk")
                    with keep[-1].lock() as v:
                        v.ptr
                    started.set()
                except dmem.StaleHandleError:
                    return
                except dmem.NotLockedError:
                    return
                except ValueError as e:
                    if "closed" in str(e):
                        return
                    raise
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    started.wait(30)
    rt.close()  # waits for the calls in flight, then destroys
    stop.set()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert rt.closed


def test_gil_released_during_blocking_calls(spill_dir):
    # While one thread is inside long runtime calls (a 32 MiB buffer to disk
    # and back), another keeps running Python: the spinner's timestamps fall
    # in the middle of the calls. An extension that kept the GIL would let
    # the spinner run only between calls (and for at most one switch
    # interval at their edges), never in their middle half. Checked: against
    # a build with -DDMEM_PY_HOLD_GIL=ON (pybridge/CMakeLists.txt) this test
    # fails ("0 of N calls").
    size = 32 << 20
    with dmem.Runtime(backend="host", host_capacity=2 * size,
                      spill_dir=str(spill_dir)) as r:
        b = r.alloc(size)
        b.write(os.urandom(size))
        stamps = []
        stop = threading.Event()

        def spin():
            clock = time.perf_counter
            last = 0.0
            while not stop.is_set():
                t = clock()
                if t - last > 2e-4:
                    stamps.append(t)
                    last = t

        windows = []
        t = threading.Thread(target=spin)
        t.start()
        try:
            for _ in range(6):
                for call in (lambda: b.spill("disk"), b.read):
                    t0 = time.perf_counter()
                    call()
                    windows.append((t0, time.perf_counter()))
        finally:
            stop.set()
            t.join()
        b.free()
    # calls long against the switch interval (5 ms), whose middle half a
    # spinner time slice at an edge cannot reach
    longest = max(t1 - t0 for t0, t1 in windows)
    long_calls = [(t0, t1) for t0, t1 in windows if t1 - t0 >= 0.02]
    if not long_calls:
        pytest.skip("no call took 20 ms (longest %.1f ms): too fast to tell" % (longest * 1e3))
    inside = sum(any(t0 + (t1 - t0) / 4 <= s <= t1 - (t1 - t0) / 4 for s in stamps)
                 for t0, t1 in long_calls)
    print("the other thread ran in the middle of %d of %d calls of 20 ms or more (longest "
          "%.1f ms)" % (inside, len(long_calls), longest * 1e3))
    # A build that keeps the GIL gives 0; a loaded machine (CI's two cores
    # running other tests) may starve the spinner in some calls, so a
    # quarter of them (at least one) is enough to tell.
    assert inside >= max(1, len(long_calls) // 4), (
        "the other thread ran in the middle of %d of %d calls of 20 ms or more"
        % (inside, len(long_calls)))
