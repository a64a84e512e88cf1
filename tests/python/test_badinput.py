"""Bad input everywhere, from Python: a table of the bad arguments of every
public callable of dmem._dmem (module functions, constructors, methods and
settable properties of Runtime, Buffer, Stream, View, DeviceMemory and
CupyAllocator), each with the typed exception it raises - TypeError for a
wrong type, ValueError for a bad value, a dmem.DmemError subclass for what
the runtime refuses - and a check that nothing changed: the statistics of
the runtime and of another one, every buffer's state, lock count, priority
and spill count, and at the end every buffer's bytes.

test_every_public_callable_has_rows enumerates the callables and fails for
one without rows, so a new method comes with its bad inputs."""

import sys

import pytest

import dmem
import dmem._dmem as _dmem

CAPACITY = 8 << 20
BUF = 64 << 10
KINDS = ("res", "host", "disk", "pinned", "locked")

# Exceptions a bad input may raise: the typed ones (BufferError: what the
# DLPack protocol asks for a refused export). Anything else (an
# OverflowError, SystemError, RuntimeError ...) is a bug.
ALLOWED = (TypeError, ValueError, AttributeError, BufferError, dmem.DmemError)


class Fixture:
    """One runtime with a buffer in every state, and another runtime."""

    def __init__(self, tmp):
        self.rt = dmem.Runtime(backend="host", host_capacity=CAPACITY, spill_dir=str(tmp))
        self.other = dmem.Runtime(backend="host", host_capacity=CAPACITY, spill_dir=str(tmp))
        self.b = {}
        for i, k in enumerate(KINDS):
            b = self.rt.alloc(BUF, pinned=(k == "pinned"))
            b.write(bytes([i + 1]) * BUF)
            self.b[k] = b
        self.b["host"].spill("host")
        self.b["disk"].spill("disk")
        self.view = self.b["locked"].lock()
        self.view.__enter__()
        self.freed = self.rt.alloc(BUF)
        self.freed.free()
        self.foreign = self.other.alloc(BUF)
        self.s = self.rt.stream()
        self.closed_s = self.rt.stream()
        self.closed_s.close()
        self.other_s = self.other.stream()
        self.raw = self.rt.device_malloc(4096)
        self.freed_raw = self.rt.device_malloc(4096)
        self.freed_raw.free()
        self.dedicated_raw = self.rt.device_malloc(4096, dedicated=True)
        self.unentered = self.b["res"].lock()  # a view never entered
        self.launches = 0

    def launch(self, stream, ptrs):
        self.launches += 1
        return len(ptrs)

    def snapshot(self):
        bufs = {k: (b.state, b.lock_count, b.priority, b.spill_count) for k, b in self.b.items()}
        return self.rt.stats(), self.other.stats(), bufs, self.foreign.state

    def check_data(self):
        self.view.__exit__(None, None, None)
        for i, k in enumerate(KINDS):
            assert self.b[k].read() == bytes([i + 1]) * BUF, k

    def close(self):
        self.raw.free()
        self.dedicated_raw.free()
        self.s.close()
        self.other_s.close()
        self.rt.close()
        self.other.close()


ROWS = []


def row(name, what, exc, call):
    """name: 'Type.member' or a module function; exc: the exception class, or
    None for a documented no-op (the call's result is then checked by
    `call` itself, which raises AssertionError when it is wrong)."""
    ROWS.append((name, what, exc, call))


def host_runtime(**kw):
    """Runtime(...) that must fail: if it does not, close it."""
    args = dict(backend="host", host_capacity=CAPACITY)
    args.update(kw)
    dmem.Runtime(**args).close()


def expect(value, want):
    assert value == want, (value, want)


# ---- module functions -------------------------------------------------------------------
row("status_name", "a str", TypeError, lambda f: dmem.status_name("DMEM_OK"))
row("status_name", "None", TypeError, lambda f: dmem.status_name(None))
row("status_name", "2**70 (unknown, not truncated)", None,
    lambda f: expect(dmem.status_name(2 ** 70), "DMEM_UNKNOWN_STATUS"))
row("status_name", "2**32 - 1 (unknown, not truncated to -1)", None,
    lambda f: expect(dmem.status_name(2 ** 32 - 1), "DMEM_UNKNOWN_STATUS"))
row("status_name", "1.0", TypeError, lambda f: dmem.status_name(1.0))
row("status_name", "a value outside the table", None,
    lambda f: expect(dmem.status_name(-999), "DMEM_UNKNOWN_STATUS"))
row("default_runtime", "device a str", TypeError, lambda f: dmem.default_runtime("0"))
row("default_runtime", "device -1", ValueError, lambda f: dmem.default_runtime(-1))
row("default_runtime", "device 64", ValueError, lambda f: dmem.default_runtime(64))
row("default_runtime", "device 2**80", ValueError, lambda f: dmem.default_runtime(2 ** 80))
row("configure", "a positional argument", TypeError, lambda f: dmem.configure("1G"))
row("configure", "an unknown keyword", TypeError, lambda f: dmem.configure(limit="1G"))
row("configure", "device_limit a list", TypeError, lambda f: dmem.configure(device_limit=[]))
row("configure", "device_limit '12Q'", ValueError, lambda f: dmem.configure(device_limit="12Q"))
row("configure", "device_limit -1", ValueError, lambda f: dmem.configure(device_limit=-1))
row("configure", "backend 'gpu'", ValueError, lambda f: dmem.configure(backend="gpu"))
row("configure", "device -1", ValueError, lambda f: dmem.configure(device=-1))
row("configure", "log_level 'chatty'", ValueError, lambda f: dmem.configure(log_level="chatty"))

# ---- Runtime(...) ---------------------------------------------------------------------------
row("Runtime", "backend 'gpu'", ValueError, lambda f: host_runtime(backend="gpu"))
row("Runtime", "backend 1", TypeError, lambda f: host_runtime(backend=1))
row("Runtime", "device -1", ValueError, lambda f: host_runtime(device=-1))
row("Runtime", "device '0'", TypeError, lambda f: host_runtime(device="0"))
row("Runtime", "device 2**70", ValueError, lambda f: host_runtime(device=2 ** 70))
row("Runtime", "device_limit -1", ValueError, lambda f: host_runtime(device_limit=-1))
row("Runtime", "device_limit 2**64", ValueError, lambda f: host_runtime(device_limit=2 ** 64))
row("Runtime", "device_limit '12Q'", ValueError, lambda f: host_runtime(device_limit="12Q"))
row("Runtime", "device_limit '0%'", ValueError, lambda f: host_runtime(device_limit="0%"))
row("Runtime", "device_limit 1.5", TypeError, lambda f: host_runtime(device_limit=1.5))
row("Runtime", "device_limit True", TypeError, lambda f: host_runtime(device_limit=True))
row("Runtime", "host_limit '50%'", ValueError, lambda f: host_runtime(host_limit="50%"))
row("Runtime", "host_capacity 0", ValueError, lambda f: host_runtime(host_capacity=0))
row("Runtime", "spill_dir 5", TypeError, lambda f: host_runtime(spill_dir=5))
row("Runtime", "spill_dir with a NUL", ValueError, lambda f: host_runtime(spill_dir="a\0b"))
row("Runtime", "an unknown keyword", TypeError, lambda f: host_runtime(limit=5))
row("Runtime", "log_level 'loud'", ValueError, lambda f: host_runtime(log_level="loud"))
row("Runtime", "log_level 7", ValueError, lambda f: host_runtime(log_level=7))
row("Runtime", "log_level 1.0", TypeError, lambda f: host_runtime(log_level=1.0))
row("Runtime", "spill_dir a file", dmem.SpillIOError, lambda f: host_runtime(spill_dir="/dev/null"))

# ---- Runtime methods ---------------------------------------------------------------------------
row("Runtime.alloc", "nbytes 0", ValueError, lambda f: f.rt.alloc(0))
row("Runtime.alloc", "nbytes -1", ValueError, lambda f: f.rt.alloc(-1))
row("Runtime.alloc", "nbytes 2**64", ValueError, lambda f: f.rt.alloc(2 ** 64))
row("Runtime.alloc", "nbytes sys.maxsize", dmem.OutOfMemoryError, lambda f: f.rt.alloc(sys.maxsize))
row("Runtime.alloc", "nbytes one past the limit", dmem.OutOfMemoryError,
    lambda f: f.rt.alloc(CAPACITY + 1))
row("Runtime.alloc", "nbytes '10'", TypeError, lambda f: f.rt.alloc("10"))
row("Runtime.alloc", "nbytes 1.5", TypeError, lambda f: f.rt.alloc(1.5))
row("Runtime.alloc", "nbytes None", TypeError, lambda f: f.rt.alloc(None))
row("Runtime.alloc", "priority 'x'", TypeError, lambda f: f.rt.alloc(10, priority="x"))
row("Runtime.alloc", "priority 2**40", ValueError, lambda f: f.rt.alloc(10, priority=2 ** 40))
row("Runtime.alloc", "an unknown keyword", TypeError, lambda f: f.rt.alloc(10, flags=1))
row("Runtime.stream", "an argument", TypeError, lambda f: f.rt.stream(1))
row("Runtime.lock_and_launch", "buffers None", TypeError, lambda f: f.rt.lock_and_launch(None, f.launch))
row("Runtime.lock_and_launch", "a Buffer, not a list", TypeError,
    lambda f: f.rt.lock_and_launch(f.b["res"], f.launch))
row("Runtime.lock_and_launch", "an int handle", TypeError,
    lambda f: f.rt.lock_and_launch([f.b["res"].handle], f.launch))
row("Runtime.lock_and_launch", "another runtime's buffer", ValueError,
    lambda f: f.rt.lock_and_launch([f.b["host"], f.foreign], f.launch))
row("Runtime.lock_and_launch", "a freed buffer after a spilled one", dmem.StaleHandleError,
    lambda f: f.rt.lock_and_launch([f.b["host"], f.b["disk"], f.freed], f.launch))
row("Runtime.lock_and_launch", "fn not callable", TypeError,
    lambda f: f.rt.lock_and_launch([f.b["host"]], 5))
row("Runtime.lock_and_launch", "duplicate buffers (allowed)", None,
    lambda f: expect(f.rt.lock_and_launch([f.b["res"], f.b["res"], f.b["locked"]], f.launch), 3))
row("Runtime.lock_and_launch", "no buffers (fn called)", None,
    lambda f: expect(f.rt.lock_and_launch([], f.launch), 0))
row("Runtime.launch_async", "stream 'x'", TypeError,
    lambda f: f.rt.launch_async("x", [f.b["res"]], f.launch))
row("Runtime.launch_async", "a closed stream", ValueError,
    lambda f: f.rt.launch_async(f.closed_s, [f.b["res"]], f.launch))
row("Runtime.launch_async", "another runtime's stream", ValueError,
    lambda f: f.rt.launch_async(f.other_s, [f.b["res"]], f.launch))
row("Runtime.launch_async", "a freed buffer after a spilled one", dmem.StaleHandleError,
    lambda f: f.rt.launch_async(f.s, [f.b["disk"], f.freed], f.launch))
row("Runtime.launch_async", "fn None", TypeError,
    lambda f: f.rt.launch_async(f.s, [f.b["res"]], None))


def _dup_async(f):
    expect(f.rt.launch_async(f.s, [f.b["res"], f.b["res"]], f.launch), 2)
    f.rt.sync_and_unlock(f.s)


row("Runtime.launch_async", "duplicate buffers (allowed; then sync_and_unlock)", None, _dup_async)
row("Runtime.sync_and_unlock", "stream 'x'", TypeError, lambda f: f.rt.sync_and_unlock("x"))
row("Runtime.sync_and_unlock", "a closed stream", ValueError, lambda f: f.rt.sync_and_unlock(f.closed_s))
row("Runtime.sync_and_unlock", "nothing registered", None, lambda f: f.rt.sync_and_unlock(f.s))
row("Runtime.stream_release", "stream 1.5", TypeError, lambda f: f.rt.stream_release(1.5))
row("Runtime.stream_release", "another runtime's stream", ValueError,
    lambda f: f.rt.stream_release(f.other_s))
row("Runtime.stream_release", "nothing registered", None, lambda f: f.rt.stream_release(f.s))
row("Runtime.synchronize", "stream 'x'", TypeError, lambda f: f.rt.synchronize("x"))
row("Runtime.synchronize", "another runtime's stream", ValueError, lambda f: f.rt.synchronize(f.other_s))
row("Runtime.evict", "nbytes -1", ValueError, lambda f: f.rt.evict(-1))
row("Runtime.evict", "nbytes '1'", TypeError, lambda f: f.rt.evict("1"))
row("Runtime.evict", "nbytes 0 (no-op)", None, lambda f: expect(f.rt.evict(0), 0))
row("Runtime.prefetch", "buffers None", TypeError, lambda f: f.rt.prefetch(None))
row("Runtime.prefetch", "a freed buffer after spilled ones", dmem.StaleHandleError,
    lambda f: f.rt.prefetch([f.b["host"], f.b["disk"], f.freed]))
row("Runtime.prefetch", "another runtime's buffer", ValueError,
    lambda f: f.rt.prefetch([f.b["host"], f.foreign]))
row("Runtime.prefetch", "stream 'x'", TypeError, lambda f: f.rt.prefetch([f.b["host"]], "x"))
row("Runtime.prefetch", "duplicate resident buffers (no-op)", None,
    lambda f: f.rt.prefetch([f.b["res"], f.b["res"], f.b["locked"]]))
row("Runtime.host_trim", "keep -1", ValueError, lambda f: f.rt.host_trim(-1))
row("Runtime.host_trim", "keep 'x'", TypeError, lambda f: f.rt.host_trim("x"))
row("Runtime.poll", "an argument", TypeError, lambda f: f.rt.poll(1))
row("Runtime.stats", "an argument", TypeError, lambda f: f.rt.stats(1))
row("Runtime.device_malloc", "nbytes 0", ValueError, lambda f: f.rt.device_malloc(0))
row("Runtime.device_malloc", "nbytes -1", ValueError, lambda f: f.rt.device_malloc(-1))
row("Runtime.device_malloc", "nbytes 2**64", ValueError, lambda f: f.rt.device_malloc(2 ** 64))
row("Runtime.device_malloc", "nbytes one past the limit", dmem.OutOfMemoryError,
    lambda f: f.rt.device_malloc(CAPACITY + 1))
row("Runtime.device_malloc", "nbytes 'x'", TypeError, lambda f: f.rt.device_malloc("x"))
row("Runtime.device_malloc", "stream 'x'", TypeError, lambda f: f.rt.device_malloc(10, "x"))
row("Runtime.device_malloc", "dedicated given positionally", TypeError,
    lambda f: f.rt.device_malloc(10, None, True))
row("Runtime.device_malloc", "dedicated, nbytes one past the limit", dmem.OutOfMemoryError,
    lambda f: f.rt.device_malloc(CAPACITY + 1, dedicated=True))
row("Runtime.memory_info", "an argument", TypeError, lambda f: f.rt.memory_info(1))
row("Runtime.stats", "an unknown keyword", TypeError, lambda f: f.rt.stats(reset=True))
row("Runtime.info", "an argument", TypeError, lambda f: f.rt.info(1))
row("Runtime.log_level", "assigned 'loud'", ValueError, lambda f: setattr(f.rt, "log_level", "loud"))
row("Runtime.log_level", "assigned 5", ValueError, lambda f: setattr(f.rt, "log_level", 5))
row("Runtime.log_level", "assigned -1", ValueError, lambda f: setattr(f.rt, "log_level", -1))
row("Runtime.log_level", "assigned 2**70", ValueError, lambda f: setattr(f.rt, "log_level", 2**70))
row("Runtime.log_level", "assigned 1.5", TypeError, lambda f: setattr(f.rt, "log_level", 1.5))
row("Runtime.log_level", "assigned True", TypeError, lambda f: setattr(f.rt, "log_level", True))
row("Runtime.log_level", "assigned None", TypeError, lambda f: setattr(f.rt, "log_level", None))
row("Runtime.log_level", "deleted", AttributeError, lambda f: delattr(f.rt, "log_level"))
row("Runtime.backend_reason", "assigned", AttributeError,
    lambda f: setattr(f.rt, "backend_reason", "x"))
row("Runtime._oom_message", "nbytes 'x'", TypeError, lambda f: f.rt._oom_message("x"))
row("Runtime._oom_message", "nbytes True", TypeError, lambda f: f.rt._oom_message(True))
row("Runtime._oom_message", "nbytes -1", ValueError, lambda f: f.rt._oom_message(-1))
row("Runtime._oom_message", "nbytes 2**64", ValueError, lambda f: f.rt._oom_message(2 ** 64))
row("Runtime.ipc_handle", "ptr 'x'", TypeError, lambda f: f.rt.ipc_handle("x"))
row("Runtime.ipc_handle", "ptr -1", ValueError, lambda f: f.rt.ipc_handle(-1))
row("Runtime.ipc_handle", "ptr 2**64", ValueError, lambda f: f.rt.ipc_handle(2 ** 64))
row("Runtime.ipc_handle", "ptr 0", dmem.InvalidArgumentError, lambda f: f.rt.ipc_handle(0))
row("Runtime.ipc_handle", "an address in no slab", dmem.InvalidArgumentError,
    lambda f: f.rt.ipc_handle(id(f)))
row("Runtime.adopt", "no arguments", TypeError, lambda f: f.rt.adopt())
row("Runtime.adopt", "mem an int", TypeError, lambda f: f.rt.adopt(f.raw.ptr))
row("Runtime.adopt", "mem a Buffer", TypeError, lambda f: f.rt.adopt(f.b["res"]))
row("Runtime.adopt", "mem freed", dmem.InvalidArgumentError, lambda f: f.rt.adopt(f.freed_raw))
row("Runtime.adopt", "mem a dedicated block", dmem.InvalidArgumentError,
    lambda f: f.rt.adopt(f.dedicated_raw))
row("Runtime.adopt", "stream 'x'", TypeError, lambda f: f.rt.adopt(f.raw, "x"))
row("Runtime.adopt", "another runtime's stream", ValueError, lambda f: f.rt.adopt(f.raw, f.other_s))
row("Runtime.adopt", "an unknown keyword", TypeError, lambda f: f.rt.adopt(f.raw, flags=1))
row("Runtime.set_controller", "an int", TypeError, lambda f: f.rt.set_controller(5))
row("Runtime.set_controller", "not a dmem.Controller", TypeError, lambda f: f.rt.set_controller(object()))
row("Runtime.set_controller", "None when there is none (no-op)", None, lambda f: f.rt.set_controller(None))
row("Runtime.close", "an argument", TypeError, lambda f: f.rt.close(1))
row("Runtime.__enter__", "an argument", TypeError, lambda f: f.rt.__enter__(1))
row("Runtime.__exit__", "no arguments", TypeError, lambda f: f.rt.__exit__())
row("Runtime.backend", "assigned", AttributeError, lambda f: setattr(f.rt, "backend", "cuda"))

# ---- Buffer ------------------------------------------------------------------------------------
row("Buffer.free", "freed already", dmem.StaleHandleError, lambda f: f.freed.free())
row("Buffer.write", "data 5", TypeError, lambda f: f.b["host"].write(5))
row("Buffer.write", "data a str", TypeError, lambda f: f.b["host"].write("abc"))
row("Buffer.write", "offset -1", ValueError, lambda f: f.b["host"].write(b"x", -1))
row("Buffer.write", "offset past the end", ValueError, lambda f: f.b["host"].write(b"x", BUF))
row("Buffer.write", "offset 2**70", ValueError, lambda f: f.b["host"].write(b"x", 2 ** 70))
row("Buffer.write", "more bytes than the buffer", ValueError,
    lambda f: f.b["host"].write(bytes(BUF + 1)))
row("Buffer.write", "a freed buffer", dmem.StaleHandleError, lambda f: f.freed.write(b"x"))
row("Buffer.read", "nbytes -1", ValueError, lambda f: f.b["disk"].read(-1))
row("Buffer.read", "nbytes past the end", ValueError, lambda f: f.b["disk"].read(BUF + 1))
row("Buffer.read", "nbytes 2**70", ValueError, lambda f: f.b["disk"].read(2 ** 70))
row("Buffer.read", "nbytes 'x'", TypeError, lambda f: f.b["disk"].read("x"))
row("Buffer.read", "offset -1", ValueError, lambda f: f.b["disk"].read(1, -1))
row("Buffer.read", "offset 2**70", ValueError, lambda f: f.b["disk"].read(1, 2 ** 70))
row("Buffer.read", "offset 'x'", TypeError, lambda f: f.b["disk"].read(1, "x"))
row("Buffer.read", "offset past the end", ValueError, lambda f: f.b["disk"].read(None, BUF + 1))
row("Buffer.read", "a freed buffer", dmem.StaleHandleError, lambda f: f.freed.read(1))
row("Buffer.peek", "nbytes -1", ValueError, lambda f: f.b["disk"].peek(-1))
row("Buffer.peek", "nbytes past the end", ValueError, lambda f: f.b["host"].peek(BUF + 1))
row("Buffer.peek", "nbytes 2**70", ValueError, lambda f: f.b["res"].peek(2 ** 70))
row("Buffer.peek", "nbytes 'x'", TypeError, lambda f: f.b["disk"].peek("x"))
row("Buffer.peek", "nbytes True", TypeError, lambda f: f.b["disk"].peek(True))
row("Buffer.peek", "offset -1", ValueError, lambda f: f.b["disk"].peek(1, -1))
row("Buffer.peek", "offset 2**70", ValueError, lambda f: f.b["host"].peek(1, 2 ** 70))
row("Buffer.peek", "offset 'x'", TypeError, lambda f: f.b["disk"].peek(1, "x"))
row("Buffer.peek", "offset past the end", ValueError, lambda f: f.b["disk"].peek(None, BUF + 1))
row("Buffer.peek", "one byte past the end", ValueError, lambda f: f.b["locked"].peek(2, BUF - 1))
row("Buffer.peek", "a freed buffer", dmem.StaleHandleError, lambda f: f.freed.peek(1))
row("Buffer.readinto", "out bytes (read-only)", TypeError,
    lambda f: f.b["disk"].readinto(b"1234"))
row("Buffer.readinto", "out an int", TypeError, lambda f: f.b["host"].readinto(5))
row("Buffer.readinto", "out None", TypeError, lambda f: f.b["res"].readinto(None))
row("Buffer.readinto", "out not contiguous", (TypeError, BufferError),
    lambda f: f.b["disk"].readinto(memoryview(bytearray(16))[::2]))
row("Buffer.readinto", "out larger than the buffer", ValueError,
    lambda f: f.b["host"].readinto(bytearray(BUF + 1)))
row("Buffer.readinto", "offset -1", ValueError, lambda f: f.b["disk"].readinto(bytearray(1), -1))
row("Buffer.readinto", "offset 2**70", ValueError,
    lambda f: f.b["disk"].readinto(bytearray(1), 2 ** 70))
row("Buffer.readinto", "offset 'x'", TypeError, lambda f: f.b["res"].readinto(bytearray(1), "x"))
row("Buffer.readinto", "offset + len(out) past the end", ValueError,
    lambda f: f.b["disk"].readinto(bytearray(2), BUF - 1))
row("Buffer.readinto", "a freed buffer", dmem.StaleHandleError,
    lambda f: f.freed.readinto(bytearray(1)))
row("Buffer.spill", "tier 'gpu'", ValueError, lambda f: f.b["res"].spill("gpu"))
row("Buffer.spill", "tier 'device'", ValueError, lambda f: f.b["res"].spill("device"))
row("Buffer.spill", "tier 1", TypeError, lambda f: f.b["res"].spill(1))
row("Buffer.spill", "controller tier without a controller", dmem.InvalidArgumentError,
    lambda f: f.b["res"].spill("controller"))
row("Buffer.spill", "a pinned buffer", dmem.BusyError, lambda f: f.b["pinned"].spill())
row("Buffer.spill", "a locked buffer", dmem.BusyError, lambda f: f.b["locked"].spill())
row("Buffer.spill", "from disk back to host", dmem.InvalidArgumentError,
    lambda f: f.b["disk"].spill("host"))
row("Buffer.spill", "a freed buffer", dmem.StaleHandleError, lambda f: f.freed.spill())
row("Buffer.spill", "to the tier it is in (no-op)", None, lambda f: f.b["host"].spill("host"))
row("Buffer.unspill", "stream 'x'", TypeError, lambda f: f.b["host"].unspill("x"))
row("Buffer.unspill", "a freed buffer", dmem.StaleHandleError, lambda f: f.freed.unspill())
row("Buffer.unspill", "resident (no-op)", None, lambda f: f.b["res"].unspill())
row("Buffer.prefetch", "stream 'x'", TypeError, lambda f: f.b["disk"].prefetch("x"))
row("Buffer.prefetch", "another runtime's stream", ValueError, lambda f: f.b["disk"].prefetch(f.other_s))
row("Buffer.prefetch", "a freed buffer", dmem.StaleHandleError, lambda f: f.freed.prefetch())
row("Buffer.lock", "stream 'x'", TypeError, lambda f: f.b["host"].lock("x"))
row("Buffer.lock", "a closed stream", ValueError, lambda f: f.b["host"].lock(f.closed_s))
row("Buffer.lock", "a freed buffer", dmem.StaleHandleError, lambda f: f.freed.lock())
row("Buffer.priority", "set to 'x'", TypeError, lambda f: setattr(f.b["res"], "priority", "x"))
row("Buffer.priority", "set to 2**40", ValueError, lambda f: setattr(f.b["res"], "priority", 2 ** 40))
row("Buffer.priority", "set to None", TypeError, lambda f: setattr(f.b["res"], "priority", None))
row("Buffer.priority", "deleted", AttributeError, lambda f: delattr(f.b["res"], "priority"))
row("Buffer.priority", "of a freed buffer", dmem.StaleHandleError, lambda f: setattr(f.freed, "priority", 1))
row("Buffer.state", "of a freed buffer", dmem.StaleHandleError, lambda f: f.freed.state)
row("Buffer.size", "assigned", AttributeError, lambda f: setattr(f.b["res"], "size", 1))

# ---- View (never entered, or another's) ------------------------------------------------------------
row("View.ptr", "before the with block", dmem.NotLockedError, lambda f: f.unentered.ptr)
row("View.size", "before the with block", dmem.NotLockedError, lambda f: f.unentered.size)
row("View.__dlpack__", "before the with block", dmem.NotLockedError, lambda f: f.unentered.__dlpack__())
row("View.__dlpack__", "stream 'x'", TypeError, lambda f: f.view.__dlpack__(stream="x"))
row("View.__dlpack__", "stream 2**70", ValueError, lambda f: f.view.__dlpack__(stream=2 ** 70))
row("View.__dlpack__", "max_version 'x'", TypeError, lambda f: f.view.__dlpack__(max_version="x"))
row("View.__dlpack__", "dl_device of another device", BufferError,
    lambda f: f.view.__dlpack__(dl_device=(2, 0)))
row("View.__dlpack__", "copy=True", BufferError, lambda f: f.view.__dlpack__(copy=True))
row("View.__dlpack_device__", "before the with block", dmem.NotLockedError,
    lambda f: f.unentered.__dlpack_device__())
row("View.__array_interface__", "before the with block", dmem.NotLockedError,
    lambda f: f.unentered.__array_interface__)
row("View.__cuda_array_interface__", "on the host backend", AttributeError,
    lambda f: f.view.__cuda_array_interface__)
row("View.__enter__", "entered twice", ValueError, lambda f: f.view.__enter__())
row("View.__exit__", "before the with block", dmem.NotLockedError,
    lambda f: f.unentered.__exit__(None, None, None))
row("View.__exit__", "no arguments", TypeError, lambda f: f.view.__exit__())

# ---- Stream -------------------------------------------------------------------------------------------
row("Stream.synchronize", "a closed stream", ValueError, lambda f: f.closed_s.synchronize())
row("Stream.synchronize", "an argument", TypeError, lambda f: f.s.synchronize(1))
row("Stream.close", "closed twice (no-op)", None, lambda f: f.closed_s.close())
row("Stream.__cuda_stream__", "a closed stream", ValueError, lambda f: f.closed_s.__cuda_stream__())
row("Stream.__enter__", "an argument", TypeError, lambda f: f.s.__enter__(1))
row("Stream.__exit__", "no arguments", TypeError, lambda f: f.s.__exit__())

# ---- DeviceMemory ---------------------------------------------------------------------------------------


def _free_twice(f):
    f.freed_raw.free()  # freed in the fixture: again is a no-op
    assert f.freed_raw.freed and f.freed_raw.ptr == 0


row("DeviceMemory.free", "freed already (no-op)", None, _free_twice)
row("DeviceMemory.free", "an argument", TypeError, lambda f: f.raw.free(1))
row("DeviceMemory.ptr", "assigned", AttributeError, lambda f: setattr(f.raw, "ptr", 0))
row("DeviceMemory.adopted", "assigned", AttributeError, lambda f: setattr(f.raw, "adopted", True))

# ---- CupyAllocator ----------------------------------------------------------------------------------------
row("CupyAllocator", "no arguments", TypeError, lambda f: _dmem.CupyAllocator())
row("CupyAllocator", "callables that are not", TypeError,
    lambda f: _dmem.CupyAllocator(1, 2, 3, 4, 5))
row("CupyAllocator", "runtime not a Runtime", TypeError,
    lambda f: _dmem.CupyAllocator(object, object, lambda: 0, lambda: 0, lambda: None, runtime=5))
row("CupyAllocator.__call__", "nbytes 'x'", TypeError,
    lambda f: _dmem.CupyAllocator(object, object, lambda: 0, lambda: 0, lambda: None,
                                  runtime=f.rt)("x"))
row("CupyAllocator.__call__", "nbytes -1", ValueError,
    lambda f: _dmem.CupyAllocator(object, object, lambda: 0, lambda: 0, lambda: None,
                                  runtime=f.rt)(-1))


# ---- running the table ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    f = Fixture(tmp_path_factory.mktemp("spill"))
    yield f
    f.check_data()
    f.close()


def _same_stats(a, b):
    # the pinned pool's figures may move on their own only when it has a
    # background thread (CUDA); the host backend has none
    return {k: v for k, v in a.items()} == {k: v for k, v in b.items()}


@pytest.mark.parametrize("name, what, exc, call", ROWS,
                         ids=[f"{r[0]}: {r[1]}" for r in ROWS])
def test_bad_input_changes_nothing(fx, name, what, exc, call):
    before = fx.snapshot()
    fx.launches = 0
    if exc is None:
        call(fx)
    else:
        with pytest.raises(exc) as info:
            call(fx)
        assert isinstance(info.value, ALLOWED), repr(info.value)
        assert fx.launches == 0, "a launch function ran"
        if isinstance(info.value, dmem.DmemError):
            assert info.value.name == dmem.status_name(info.value.status)
    after = fx.snapshot()
    assert _same_stats(before[0], after[0]), "the runtime's statistics changed"
    assert _same_stats(before[1], after[1]), "the other runtime's statistics changed"
    assert before[2] == after[2], "a buffer changed"
    assert before[3] == after[3], "the other runtime's buffer changed"


# ---- every public callable has rows ---------------------------------------------------------------------------

# Special methods that are part of the public surface (the rest come from object).
SPECIAL = {"__enter__", "__exit__", "__dlpack__", "__dlpack_device__", "__cuda_array_interface__",
           "__array_interface__", "__cuda_stream__", "__call__"}


def public_callables(instances):
    """'func' for module functions, 'Type' for types made by calling them,
    'Type.member' for methods, settable properties and the special members.
    Read-only properties take no input: they are left out (their use on a
    freed or closed object has rows where it raises). instances: one
    object of each type, to tell settable properties from read-only ones."""
    names = set()
    for n in dir(_dmem):
        o = getattr(_dmem, n)
        if n.startswith("_"):
            continue
        if isinstance(o, type):
            if issubclass(o, BaseException):
                continue
            if "__new__" in o.__dict__:  # constructible from Python
                names.add(n)
            for m, v in o.__dict__.items():
                if m.startswith("__") and m not in SPECIAL:
                    continue
                kind = type(v).__name__
                if kind in ("method_descriptor", "wrapper_descriptor", "builtin_function_or_method"):
                    names.add(f"{n}.{m}")
                elif kind == "getset_descriptor" and (m in SPECIAL or _settable(v, instances[n])):
                    names.add(f"{n}.{m}")
        elif callable(o):
            names.add(n)
    return names


def _settable(descr, obj):
    """A getset descriptor without a setter refuses any value with 'not
    writable'; one with a setter judges the value (None: a TypeError)."""
    try:
        descr.__set__(obj, None)
    except AttributeError as e:
        return "not writable" not in str(e)
    except (TypeError, ValueError):
        return True
    return True


def test_every_public_callable_has_rows(fx):
    have = {r[0] for r in ROWS}
    cupy = _dmem.CupyAllocator(object, object, lambda: 0, lambda: 0, lambda: None, runtime=fx.rt)
    instances = {"Runtime": fx.rt, "Buffer": fx.b["res"], "Stream": fx.s, "View": fx.view,
                 "DeviceMemory": fx.raw, "CupyAllocator": cupy}
    found = public_callables(instances)
    missing = sorted(found - have)
    assert not missing, f"public callables without bad-input rows: {missing}"
    # the scan works: it sees what we know is there
    for known in ("Runtime", "Runtime.alloc", "Buffer.priority", "View.__dlpack__", "status_name",
                  "Stream.synchronize", "DeviceMemory.free", "CupyAllocator.__call__"):
        assert known in found, known
    # and every row names something that exists (read-only properties too)
    def exists(name):
        owner, _, member = name.partition(".")
        o = getattr(_dmem, owner, None)
        return o is not None and (not member or member in o.__dict__)

    unknown = sorted(n for n in have if not exists(n))
    assert not unknown, f"rows for names dmem._dmem does not have: {unknown}"
