"""dmem.dask.DmemWorkerData checked against a dict (hypothesis).

A RuleBasedStateMachine drives the mapping on the host backend (a 1 MiB
device limit, so that storing and reading keys spills others) with what a
worker does to it: set (NumPy arrays of several dtypes, shapes and layouts,
containers of them, host values), get, delete, hold a returned array across
later rules (a task still running) and drop it, evict() (the memory
manager), explicit spills of a key's buffers to host or disk, and a
transfer (get_data's DmemValue through the dask serializer family).

After every rule: every key reads back equal to the model, the mapping's
keys are the model's, every stored buffer exists exactly once
(buffer_count), held arrays keep their buffers locked and nothing else is
locked.

CI runs a fixed, derandomised set of 25 examples; DMEM_HYPOTHESIS_EXAMPLES=N
runs N random ones.
"""

import gc
import os
import shutil
import tempfile

import pytest

np = pytest.importorskip("numpy")
pytest.importorskip("hypothesis")
pytest.importorskip("distributed")

from distributed.protocol import deserialize, serialize  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import dmem  # noqa: E402
from dmem.dask import DmemValue, DmemWorkerData  # noqa: E402
from dmem import arrays as _arrays  # noqa: E402
from dmem.dask import data as ddata  # noqa: E402

KiB = 1 << 10
EXAMPLES = int(os.environ.get("DMEM_HYPOTHESIS_EXAMPLES") or 0)
KEYS = st.sampled_from(["a", "b", "c", ("x", 0), ("x", 1), ("y", 2, 3), "d", "e"])
DTYPES = st.sampled_from(["f8", "f4", "i8", "i2", "u1", "c16"])


@st.composite
def arrays(draw):
    dt = np.dtype(draw(DTYPES))
    shape = tuple(draw(st.lists(st.integers(1, 48), min_size=1, max_size=3)))
    seed = draw(st.integers(0, 1 << 30))
    a = (np.random.default_rng(seed).integers(0, 100, size=shape)).astype(dt)
    layout = draw(st.sampled_from(["C", "F", "strided"]))
    if layout == "F":
        a = np.asfortranarray(a)
    elif layout == "strided" and a.ndim >= 1 and a.shape[0] > 1:
        a = a[::2]
    return a


VALUES = st.one_of(
    arrays(),
    st.tuples(arrays(), st.text(max_size=3)),
    st.builds(lambda a, b: {"p": a, "q": [b, 7]}, arrays(), arrays()),
    st.binary(max_size=64),
    st.integers(),
)


def same(got, want):
    if isinstance(want, np.ndarray):
        return isinstance(got, np.ndarray) and got.dtype == want.dtype and \
            got.shape == want.shape and np.array_equal(got, want)
    if isinstance(want, (tuple, list)):
        return type(got) is type(want) and len(got) == len(want) and \
            all(same(g, w) for g, w in zip(got, want))
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and \
            all(same(got[k], want[k]) for k in want)
    return got == want


def copy(v):
    if isinstance(v, np.ndarray):
        return v.copy()
    if isinstance(v, tuple):
        return tuple(copy(x) for x in v)
    if isinstance(v, list):
        return [copy(x) for x in v]
    if isinstance(v, dict):
        return {k: copy(x) for k, x in v.items()}
    return v


class MappingModel(RuleBasedStateMachine):
    @initialize()
    def start(self):
        self.dir = tempfile.mkdtemp(prefix="dmem-dask-model-")
        self.rt = dmem.Runtime(backend="host", host_capacity=2 << 20, device_limit=1 << 20,
                               spill_dir=self.dir)
        self.d = DmemWorkerData(runtime=self.rt, worker_local_directory=self.dir)
        self.model = {}
        self.held = []  # (key, array) returned to a "task" that still runs

    def teardown(self):
        if hasattr(self, "d"):
            self.held.clear()
            self.d.close()
            gc.collect()
            self.rt.close()
        if hasattr(self, "dir"):
            shutil.rmtree(self.dir, ignore_errors=True)

    @rule(key=KEYS, value=VALUES)
    def set(self, key, value):
        self.d[key] = value
        self.model[key] = copy(value)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def get(self, data):
        key = data.draw(st.sampled_from(sorted(self.model, key=repr)))
        assert same(self.d[key], self.model[key])

    @precondition(lambda self: self.model and len(self.held) < 4)
    @rule(data=st.data())
    def hold(self, data):
        key = data.draw(st.sampled_from(sorted(self.model, key=repr)))
        self.held.append((key, self.d[key], copy(self.model[key])))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data):
        i = data.draw(st.integers(0, len(self.held) - 1))
        key, v, want = self.held.pop(i)
        # still the value it had, whatever became of the key since
        # (replaced, deleted, its other buffers spilled)
        assert same(v, want)
        del v
        gc.collect()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete(self, data):
        key = data.draw(st.sampled_from(sorted(self.model, key=repr)))
        del self.d[key]
        del self.model[key]

    @rule()
    def evict(self):
        n = self.d.evict()
        assert n >= -1  # -1: nothing to evict; a host value may weigh 0 (b"")

    @precondition(lambda self: self.d._dev)
    @rule(data=st.data(), tier=st.sampled_from(["host", "disk"]))
    def spill(self, data, tier):
        key = data.draw(st.sampled_from(sorted(self.d._dev, key=repr)))
        for leaf in self.d._dev[key].leaves:
            if tier == "host" and leaf.buf.state != "resident":
                continue  # dmem moves bytes down the tiers only (a lock brings them up)
            try:
                leaf.buf.spill(tier)
            except dmem.BusyError:  # held by a "task"
                assert leaf.buf.lock_count > 0

    @precondition(lambda self: self.d._dev)
    @rule(data=st.data())
    def transfer(self, data):
        key = data.draw(st.sampled_from(sorted(self.d._dev, key=repr)))
        states = [leaf.buf.state for leaf in self.d._dev[key].leaves]
        token = ddata.for_transfer.set(True)
        try:
            v = self.d[key]
        finally:
            ddata.for_transfer.reset(token)
        assert isinstance(v, DmemValue)
        header, frames = serialize(v, serializers=("dask",))
        assert same(deserialize(header, frames), self.model[key])
        # read where they were: nothing moved
        assert [leaf.buf.state for leaf in self.d._dev[key].leaves] == states

    @invariant()
    def agrees(self):
        if not hasattr(self, "d"):
            return
        assert set(self.d) == set(self.model)
        assert len(self.d) == len(self.model)
        leaves = [leaf for e in self.d._dev.values() for leaf in e.leaves]
        s = self.rt.stats()
        # one buffer per stored array, plus those of deleted keys a held
        # array still uses
        assert s["buffer_count"] >= len(leaves)
        for leaf in leaves:
            if leaf.buf.lock_count:
                assert self.held, "a buffer is locked with no array held"


MappingModel.TestCase.settings = settings(
    max_examples=EXAMPLES or 25,
    stateful_step_count=30,
    deadline=None,
    derandomize=not EXAMPLES,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

TestMappingModel = MappingModel.TestCase


def test_strided_arrays_keep_their_values(tmp_path):
    # what the model's "strided" layout stores: a copy, C-contiguous
    a = np.arange(100, dtype="i8").reshape(10, 10)[::2, 1::3]
    assert not a.flags.c_contiguous
    rt = dmem.Runtime(backend="host", host_capacity=1 << 20)
    d = DmemWorkerData(runtime=rt, worker_local_directory=str(tmp_path))
    d["k"] = a
    got = d["k"]
    assert np.array_equal(got, a) and got.flags.c_contiguous
    assert _arrays.leaves_of(d._dev["k"].tree)[0].nbytes == a.nbytes
    del got
    d.close()
    gc.collect()
    rt.close()
