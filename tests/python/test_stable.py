"""rt.alloc(n, stable=True): DMEM_BUFFER_STABLE_ADDRESS through Python. The
device address (view.ptr while locked) stays the same across spills to host
and disk and back, the bytes survive, and bad combinations raise typed
exceptions. Host backend (its ranges are reserved address space: the same
address comes back after an unspill)."""
import pytest

import dmem

KiB = 1 << 10
MiB = 1 << 20


def ptr_of(b):
    with b.lock() as v:
        return v.ptr


def test_address_stable_across_spills(rt):
    b = rt.alloc(100 * KiB, stable=True)
    p0 = ptr_of(b)
    assert p0 != 0
    for i, tier in enumerate(["host", "disk", "host", "disk"]):
        data = bytes([i + 1]) * (100 * KiB)
        b.write(data)
        b.spill(tier)
        assert b.state != "resident"
        assert ptr_of(b) == p0
        assert b.read() == data


def test_ordinary_and_stable_under_pressure(rt):
    # 8 MiB simulated device: 24 MiB of buffers, half of them stable
    bufs = []
    for i in range(24):
        b = rt.alloc(MiB - 4096, stable=(i % 2 == 0))
        b.write(bytes([i]) * (MiB - 4096))
        bufs.append(b)
    addrs = {i: ptr_of(b) for i, b in enumerate(bufs) if i % 2 == 0}
    for _ in range(3):
        for i, b in enumerate(bufs):
            if i % 2 == 0:
                assert ptr_of(b) == addrs[i]
            assert b.read(16) == bytes([i]) * 16
    assert rt.stats()["spill_count"] > 0


def test_stable_bad_arguments(rt):
    with pytest.raises(dmem.InvalidArgumentError):
        rt.alloc(4096, stable=True, pinned=True)
    with pytest.raises(ValueError):
        rt.alloc(4096, stable=True, pinned=True)
    with pytest.raises(dmem.OutOfMemoryError):
        rt.alloc(1 << 40, stable=True)
    with pytest.raises(TypeError):
        rt.alloc(4096, stabel=True)
    # stable=False is the ordinary path
    b = rt.alloc(4096, stable=False)
    b.write(b"x" * 4096)
    assert b.read(1) == b"x"
