"""Runtime.adopt: a raw block (DeviceMemory) becomes a spillable Buffer in
place; the DeviceMemory holds the buffer's one lock until it is freed or
collected. Host backend: device memory is host memory, so ctypes reads and
writes the raw block directly."""

import ctypes
import gc
import os
import subprocess
import sys
import textwrap

import pytest

import dmem

N = 100_000  # not a multiple of the pool's 256-byte alignment


def pattern(n, seed):
    return bytes((i * 31 + seed) & 0xFF for i in range(n))


def raw_write(mem, data):
    ctypes.memmove(mem.ptr, data, len(data))


def raw_read(ptr, n):
    return ctypes.string_at(ptr, n)


def test_adopt_keeps_address_and_bytes_and_moves_accounting(rt):
    mem = rt.device_malloc(N)
    raw_write(mem, pattern(N, 1))
    ptr = mem.ptr
    before = rt.stats()
    assert before["raw_used"] == N and before["buffer_count"] == 0
    assert not mem.adopted
    buf = rt.adopt(mem)
    assert isinstance(buf, dmem.Buffer)
    assert mem.adopted and not mem.freed
    assert mem.ptr == ptr  # still readable, same address
    assert buf.size == N and buf.state == "resident"
    assert buf.lock_count == 1  # the DeviceMemory's lock
    assert buf.read() == pattern(N, 1)  # the same bytes, no copy
    buf.write(pattern(N, 2))
    assert raw_read(ptr, N) == pattern(N, 2)  # written through the buffer, seen at ptr
    after = rt.stats()
    assert after["raw_used"] == 0
    assert after["buffer_count"] == 1
    assert after["device_used"] == before["device_used"]  # counted once
    assert after["device_locked"] == N
    assert "adopted" in repr(mem)
    del buf  # the Buffer is collected: freed, reclaimed at the DeviceMemory's unlock
    gc.collect()
    assert rt.stats()["device_used"] == N
    mem.free()
    assert mem.freed and mem.ptr == 0 and mem.adopted
    mem.free()  # again: nothing (the unlock happened once)
    st = rt.stats()
    assert st["device_used"] == 0 and st["buffer_count"] == 0 and st["raw_used"] == 0


def test_locked_while_the_device_memory_lives_then_spills_intact(rt):
    mem = rt.device_malloc(N)
    raw_write(mem, pattern(N, 3))
    buf = rt.adopt(mem)
    assert buf.lock_count == 1
    with pytest.raises(dmem.BusyError):
        buf.spill("host")
    assert buf.state == "resident"
    del mem
    gc.collect()
    assert buf.lock_count == 0
    assert rt.stats()["device_locked"] == 0
    buf.spill("host")
    assert buf.state == "deferred_host"
    assert rt.stats()["host_used"] == N
    assert buf.read() == pattern(N, 3)
    buf.spill("disk")
    assert buf.state == "deferred_disk"
    buf.unspill()
    rt.synchronize()
    assert buf.state == "resident"
    assert buf.read() == pattern(N, 3)
    buf.free()
    st = rt.stats()
    assert st["device_used"] == 0 and st["host_used"] == 0 and st["disk_used"] == 0
    assert st["buffer_count"] == 0


def test_adopted_block_is_not_raw_any_more(rt):
    mem = rt.device_malloc(4096)
    buf = rt.adopt(mem)
    with pytest.raises(dmem.InvalidArgumentError, match="adopted already"):
        rt.adopt(mem)
    assert rt.stats()["raw_used"] == 0 and rt.stats()["buffer_count"] == 1
    other = rt.device_malloc(4096)  # the pool does not hand the block out again
    assert other.ptr != mem.ptr
    other.free()
    assert buf.lock_count == 1
    mem.free()
    assert buf.lock_count == 0
    buf.free()
    assert rt.stats()["device_used"] == 0


def test_adopt_refuses_what_it_cannot_take(rt, spill_dir):
    with pytest.raises(TypeError):
        rt.adopt(1234)
    with pytest.raises(TypeError):
        rt.adopt(rt.alloc(16))
    freed = rt.device_malloc(4096)
    freed.free()
    with pytest.raises(dmem.InvalidArgumentError, match="freed"):
        rt.adopt(freed)
    ded = rt.device_malloc(4096, dedicated=True)
    with pytest.raises(dmem.InvalidArgumentError, match="dedicated"):
        rt.adopt(ded)
    assert not ded.adopted and rt.stats()["raw_used"] == 4096  # still raw
    ded.free()
    with dmem.Runtime(backend="host", host_capacity=8 << 20, spill_dir=str(spill_dir)) as rt2:
        foreign = rt2.device_malloc(4096)
        with pytest.raises(dmem.InvalidArgumentError, match="another runtime"):
            rt.adopt(foreign)
        assert not foreign.adopted
        foreign.free()
    assert rt.stats()["buffer_count"] == 0 and rt.stats()["raw_used"] == 0


def test_adopt_on_a_stream(rt):
    s = rt.stream()
    mem = rt.device_malloc(8192, stream=s)
    raw_write(mem, pattern(8192, 4))
    buf = rt.adopt(mem)  # stream None: mem's own
    assert buf.read() == pattern(8192, 4)
    mem2 = rt.device_malloc(8192, stream=s)
    buf2 = rt.adopt(mem2, s)  # given explicitly
    with pytest.raises(TypeError):
        rt.adopt(rt.device_malloc(16), "x")
    del mem, mem2
    gc.collect()
    assert buf.lock_count == 0 and buf2.lock_count == 0
    s.close()
    buf.free()
    buf2.free()
    assert rt.stats()["device_used"] == 0


def test_freed_buffer_is_reclaimed_at_the_device_memory_unlock(rt):
    mem = rt.device_malloc(N)
    raw_write(mem, pattern(N, 5))
    buf = rt.adopt(mem)
    buf.free()  # stale at once; the memory stays while mem holds its lock
    with pytest.raises(dmem.StaleHandleError):
        buf.read()
    assert rt.stats()["device_used"] == N
    assert raw_read(mem.ptr, N) == pattern(N, 5)  # untouched while held
    del mem
    gc.collect()
    st = rt.stats()
    assert st["device_used"] == 0 and st["buffer_count"] == 0


def test_adopt_with_a_controller_sees_the_alloc(rt):
    events = []

    class C(dmem.Controller):
        def on_alloc(self, buf):
            events.append(("alloc", buf.size, buf.lock_count))

        def on_free(self, handle):
            events.append(("free", handle))

    rt.set_controller(C())
    mem = rt.device_malloc(4096)
    buf = rt.adopt(mem)
    assert events == [("alloc", 4096, 1)]
    mem.free()
    handle = buf.handle
    buf.free()
    assert events == [("alloc", 4096, 1), ("free", handle)]


def test_close_with_an_adopted_device_memory_still_held(spill_dir):
    # in a child: a crash there must fail the test, not the test run
    code = textwrap.dedent(f"""
        import gc, dmem
        rt = dmem.Runtime(backend="host", host_capacity=8 << 20, spill_dir={str(spill_dir)!r})
        mem = rt.device_malloc(4096)
        buf = rt.adopt(mem)
        rt.close()
        assert mem.freed
        mem.free()   # nothing: the memory went with the runtime
        with_stale = False
        try:
            buf.read()
        except dmem.StaleHandleError:
            with_stale = True
        assert with_stale
        del mem, buf
        gc.collect()
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
