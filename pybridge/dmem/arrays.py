"""dmem.arrays: device arrays kept in dmem buffers, and arrays viewing them again.

What any integration that stores arrays in dmem needs (``dmem.dask`` uses it;
a new framework integration should too, instead of a copy of its own):

Classification
    ``array_kind(runtime, value)``: ``'numpy'``, ``'cupy'``, ``'numba'`` or
    None: which arrays count as this runtime's device arrays:

    - ``cuda`` backend: CuPy arrays and Numba device arrays
      (``__cuda_array_interface__``);
    - ``host`` backend: NumPy arrays (the host backend's "device" memory is
      host memory), exposed again as NumPy arrays.

    Arrays of object dtype and empty arrays are never device arrays (their
    bytes are not the value).

One array
    ``store(runtime, value, kind, stream=None)`` -> :class:`Leaf`: the array
    in a new dmem buffer (one copy; a non-contiguous array is stored
    contiguous), or in place when ``adopt`` can take its allocation.
    ``adopt(runtime, array, kind)`` -> :class:`Leaf` or None: a CuPy array
    whose memory came from ``dmem.cupy``'s allocator over this runtime
    (recognised by ``dmem.cupy.device_memory_of``, never by a class name)
    becomes a buffer without a copy (``Runtime.adopt``), locked while the
    allocation's ``DeviceMemory`` lives. ``expose(leaf, stream=None)``: an
    array of the stored type viewing the locked buffer; the lock lasts exactly
    as long as the array or any view of it lives. ``peek(leaf)``: the bytes,
    read where they are (no unspill). ``discard(leaf)``: free the buffer,
    ignoring errors (an exposed buffer goes when its arrays do).

Values (trees)
    A stored value is a *tree*: tuples, lists and dicts (exact types, nested
    up to 64 levels) whose leaves are either a :class:`Leaf` or any other
    object, kept as it is. ``pack(runtime, value, stream=None)`` ->
    ``(tree, leaves)`` or ``(None, [])`` when the value holds no device array;
    ``unpack(tree, stream=None)`` exposes every leaf; ``leaves_of(tree)``.

Transfer form
    ``skeleton(tree)``: the tree with each leaf replaced by its index and
    metadata (picklable); ``rebuild(skeleton, frames, device)``: the value
    again from one frame of bytes per leaf; ``materialize(tree, device)``:
    the value as plain arrays read where the bytes are (no unspill).

Errors: ``pack`` and ``store`` free the buffers they made before raising;
the runtime's exceptions (``dmem.OutOfMemoryError``, ...) pass through.
Thread safety: the functions keep no state of their own; concurrent calls on
different leaves are safe, and a leaf's buffer is as thread-safe as any
``dmem.Buffer``. Importing this module imports neither CuPy nor Numba.
"""

import sys

import numpy

from . import cupy as _dmem_cupy

__all__ = ["Leaf", "array_kind", "store", "adopt", "expose", "peek", "discard", "pack",
           "unpack", "leaves_of", "skeleton", "rebuild", "materialize"]


class Leaf:
    """One array in one dmem buffer: ``buf`` holds it at ``offset`` (0 except
    for an adopted allocation), in the layout given by shape/dtype/strides
    (C or Fortran contiguous)."""

    __slots__ = ("buf", "offset", "nbytes", "shape", "dtype", "strides", "kind", "adopted")

    def __init__(self, buf, offset, nbytes, shape, dtype, strides, kind, adopted=False):
        self.buf = buf
        self.offset = offset
        self.nbytes = nbytes
        self.shape = shape
        self.dtype = dtype
        self.strides = strides
        self.kind = kind
        self.adopted = adopted

    def meta(self):
        """What a receiver needs to rebuild the array from its bytes."""
        return {
            "kind": self.kind,
            "nbytes": self.nbytes,
            "shape": list(self.shape),
            "dtype": self.dtype.str if not self.dtype.fields else self.dtype.descr,
            "strides": list(self.strides),
        }

    def __reduce__(self):
        # A Leaf names a buffer of this process: it never travels. Senders
        # (dmem.dask's serializers) send its bytes instead.
        raise TypeError("a dmem.arrays Leaf cannot be pickled; send its bytes (peek, skeleton)")


# ---- classification --------------------------------------------------------------


def _cupy():
    return sys.modules.get("cupy")


def _numba_devicearray():
    m = sys.modules.get("numba.cuda.cudadrv.devicearray")
    return getattr(m, "DeviceNDArray", None) if m is not None else None


def array_kind(runtime, value):
    """'numpy', 'cupy', 'numba', or None when value is not a device array of
    this runtime's backend."""
    if runtime.backend == "host":
        if type(value) is numpy.ndarray and not value.dtype.hasobject and value.nbytes > 0:
            return "numpy"
        return None
    cp = _cupy()
    if cp is not None and isinstance(value, cp.ndarray):
        return "cupy" if value.nbytes > 0 and not value.dtype.hasobject else None
    dna = _numba_devicearray()
    if dna is not None and isinstance(value, dna):
        return "numba" if value.nbytes > 0 else None
    return None


# ---- packing -----------------------------------------------------------------------


def pack(runtime, value, stream=None):
    """(tree, leaves) with every device array of value copied into (or
    adopted as) a dmem buffer, or (None, []) when value holds none. On an
    error the buffers made so far are freed and the error raised."""
    leaves = []
    try:
        tree = _pack(runtime, value, leaves, stream, 0)
    except BaseException:
        for leaf in leaves:
            _free_quietly(leaf.buf)
        raise
    if not leaves:
        return None, []
    return tree, leaves


def _pack(runtime, value, leaves, stream, depth):
    t = type(value)
    if depth < 64 and t in (tuple, list):
        return (t.__name__, [_pack(runtime, v, leaves, stream, depth + 1) for v in value])
    if depth < 64 and t is dict:
        return ("dict", [(k, _pack(runtime, v, leaves, stream, depth + 1)) for k, v in value.items()])
    kind = array_kind(runtime, value)
    if kind is None:
        return ("obj", value)
    leaf = store(runtime, value, kind, stream)
    leaves.append(leaf)
    return ("leaf", leaf)


def _contiguous(value, xp):
    if value.flags.c_contiguous or value.flags.f_contiguous:
        return value
    return xp.ascontiguousarray(value)


def store(runtime, value, kind, stream=None):
    """A Leaf holding the array value (of kind ``array_kind(runtime, value)``)
    in a dmem buffer of runtime: adopted in place when ``adopt`` can, else
    copied into a new buffer (on stream, for device arrays). On an error the
    new buffer is freed and the error raised."""
    if kind == "numpy":
        a = _contiguous(value, numpy)
        buf = runtime.alloc(a.nbytes)
        try:
            buf.write(a.ravel(order="K").view(numpy.uint8))
        except BaseException:
            _free_quietly(buf)
            raise
        return Leaf(buf, 0, a.nbytes, a.shape, a.dtype, a.strides, kind)
    cp = _cupy()
    if kind == "numba":
        if cp is None:
            raise ImportError("dmem.arrays needs CuPy to store Numba device arrays")
        src = cp.asarray(value)  # zero-copy through __cuda_array_interface__
    else:
        src = value
    src = _contiguous(src, cp)
    leaf = adopt(runtime, src, kind)
    if leaf is not None:
        return leaf
    buf = runtime.alloc(src.nbytes)
    try:
        view = buf.lock(stream)
        with view:
            dst = cp.asarray(view)
            dst[...] = src.ravel(order="K").view(cp.uint8)
            del dst
        del view
    except BaseException:
        _free_quietly(buf)
        raise
    return Leaf(buf, 0, src.nbytes, src.shape, src.dtype, src.strides, kind)


def adopt(runtime, array, kind="cupy"):
    """A Leaf over the array's own allocation, without a copy, when that
    allocation is a ``dmem.DeviceMemory`` of this runtime (made by
    ``dmem.cupy``'s allocator: ``dmem.cupy.device_memory_of(array)``), not
    adopted yet, and holds the array's bytes; else None. The buffer
    (``Runtime.adopt``) is ordered after the block's own stream and stays
    locked until that DeviceMemory is collected."""
    rt_adopt = getattr(runtime, "adopt", None)
    owner = _dmem_cupy.device_memory_of(array)
    if rt_adopt is None or owner is None:
        return None
    if owner.runtime is not runtime or owner.freed or owner.adopted:
        return None
    offset = array.data.ptr - owner.ptr
    if offset < 0 or offset + array.nbytes > owner.size:
        return None
    try:
        buf = rt_adopt(owner)
    except (ValueError, TypeError):
        return None
    return Leaf(buf, offset, array.nbytes, array.shape, array.dtype, array.strides, kind,
                adopted=True)


def discard(leaf):
    """Free the leaf's buffer, ignoring errors (an exposed buffer goes when
    its arrays do; a freed one stays freed)."""
    _free_quietly(leaf.buf)


def _free_quietly(buf):
    try:
        buf.free()
    except Exception:
        pass


def leaves_of(tree):
    """The Leafs of a tree, in order (the order skeleton numbers them)."""
    out = []
    _walk(tree, out)
    return out


def _walk(tree, out):
    tag, body = tree
    if tag == "leaf":
        out.append(body)
    elif tag in ("tuple", "list"):
        for t in body:
            _walk(t, out)
    elif tag == "dict":
        for _, t in body:
            _walk(t, out)


# ---- unpacking (exposure) ------------------------------------------------------------


class _CudaArray:
    """An object with one __cuda_array_interface__ that keeps the locked
    View (through ``owner``) alive for as long as the consumer keeps it."""

    __slots__ = ("__cuda_array_interface__", "owner")

    def __init__(self, ptr, leaf, owner):
        self.owner = owner
        self.__cuda_array_interface__ = {
            "version": 3,
            "data": (ptr, False),
            "shape": tuple(leaf.shape),
            "typestr": leaf.dtype.str,
            "descr": leaf.dtype.descr,
            "strides": tuple(leaf.strides),
            "stream": None,
        }


def expose(leaf, stream=None):
    """An array viewing the leaf's buffer, locked (and unspilled) for as long
    as the array or any view of it lives."""
    view = leaf.buf.lock(stream)
    with view:
        if leaf.kind == "numpy":
            raw = numpy.asarray(view)
            return numpy.ndarray(leaf.shape, leaf.dtype, buffer=raw, offset=leaf.offset,
                                 strides=leaf.strides)
        cp = _cupy()
        if leaf.kind == "cupy":
            raw = cp.asarray(view)
            return cp.ndarray(leaf.shape, leaf.dtype, memptr=raw.data + leaf.offset,
                              strides=leaf.strides)
        from numba import cuda

        return cuda.as_cuda_array(_CudaArray(view.ptr + leaf.offset, leaf, view))


def unpack(tree, stream=None):
    """The value of a tree, each leaf exposed (see expose)."""
    tag, body = tree
    if tag == "leaf":
        return expose(body, stream)
    if tag == "obj":
        return body
    if tag == "tuple":
        return tuple(unpack(t, stream) for t in body)
    if tag == "list":
        return [unpack(t, stream) for t in body]
    return {k: unpack(t, stream) for k, t in body}


# ---- transfer form ---------------------------------------------------------------------


def skeleton(tree):
    """tree with each Leaf replaced by ('leaf', index, meta): picklable."""
    counter = [0]

    def go(t):
        tag, body = t
        if tag == "leaf":
            i = counter[0]
            counter[0] += 1
            return ("leaf", (i, body.meta()))
        if tag == "obj":
            return t
        if tag == "dict":
            return (tag, [(k, go(s)) for k, s in body])
        return (tag, [go(s) for s in body])

    return go(tree)


def _dtype(d):
    return numpy.dtype(d if isinstance(d, str) else [tuple(f) for f in d])


def rebuild(skel, frames, device):
    """The value of a skeleton with leaf i's bytes in frames[i]: NumPy arrays
    for 'numpy' leaves; CuPy arrays (Numba arrays for 'numba' leaves) when
    device is True, else NumPy arrays for every leaf."""
    tag, body = skel
    if tag == "leaf":
        i, m = body
        dt = _dtype(m["dtype"])
        frame = frames[i]
        if m["kind"] != "numpy" and device:
            cp = _cupy()
            if cp is None:
                import cupy as cp  # noqa: F811
            if not hasattr(frame, "__cuda_array_interface__"):
                frame = numpy.frombuffer(frame, dtype=numpy.uint8)
            raw = cp.asarray(frame)
            arr = cp.ndarray(tuple(m["shape"]), dt, memptr=raw.data, strides=tuple(m["strides"]))
            if m["kind"] == "numba":
                from numba import cuda

                return cuda.as_cuda_array(arr)
            return arr
        if hasattr(frame, "__cuda_array_interface__"):
            frame = _cupy().asnumpy(frame)
        raw = numpy.frombuffer(frame, dtype=numpy.uint8)
        if not raw.flags.writeable:
            raw = raw.copy()
        return numpy.ndarray(tuple(m["shape"]), dt, buffer=raw, strides=tuple(m["strides"]))
    if tag == "obj":
        return body
    if tag == "tuple":
        return tuple(rebuild(s, frames, device) for s in body)
    if tag == "list":
        return [rebuild(s, frames, device) for s in body]
    return {k: rebuild(s, frames, device) for k, s in body}


def peek(leaf):
    """The leaf's bytes, read from the tier they are in (Buffer.peek: no
    unspill, nothing locked after the read)."""
    return leaf.buf.peek(leaf.nbytes, leaf.offset)


def materialize(tree, device):
    """The value as plain arrays, read where the bytes are (no unspill)."""
    return rebuild(skeleton(tree), [peek(leaf) for leaf in leaves_of(tree)], device)
