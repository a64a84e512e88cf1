"""Array leaves of dmem.dask: how a value's arrays become dmem buffers and
come back as arrays.

A stored value is a *tree*: tuples, lists and dicts (exact types) whose
leaves are either :class:`Leaf` (one array kept in a dmem buffer) or any
other object, kept as it is. What counts as an array depends on the
runtime's backend:

- ``cuda``: CuPy arrays and Numba device arrays (``__cuda_array_interface__``).
- ``host``: NumPy arrays (the host backend's "device" memory is host memory),
  exposed again as NumPy arrays through ``__array_interface__``.

Arrays of object dtype and empty arrays are never leaves (their bytes are not
the value). Nothing in this module takes a lock of the mapping.
"""

import sys

import numpy

__all__ = ["Leaf", "pack", "unpack", "expose", "leaves_of", "peek", "materialize", "skeleton",
           "rebuild"]


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
        # A Leaf names a buffer of this process: it never travels. The
        # serializers of DmemValue send its bytes instead.
        raise TypeError("a dmem.dask Leaf cannot be pickled; serialize its DmemValue")


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
    leaf = _store(runtime, value, kind, stream)
    leaves.append(leaf)
    return ("leaf", leaf)


def _contiguous(value, xp):
    if value.flags.c_contiguous or value.flags.f_contiguous:
        return value
    return xp.ascontiguousarray(value)


def _store(runtime, value, kind, stream):
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
            raise ImportError("dmem.dask needs CuPy to store Numba device arrays")
        src = cp.asarray(value)  # zero-copy through __cuda_array_interface__
    else:
        src = value
    src = _contiguous(src, cp)
    leaf = _adopt(runtime, src, kind, stream)
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


def _adopt(runtime, src, kind, stream):
    """A Leaf over src's own allocation when it came from this runtime's
    allocator (dmem.cupy), without a copy; else None."""
    adopt = getattr(runtime, "adopt", None)
    mem = getattr(getattr(src, "data", None), "mem", None)
    owner = getattr(mem, "_owner", None)
    if adopt is None or owner is None or type(owner).__name__ != "DeviceMemory":
        return None
    if getattr(owner, "runtime", None) is not runtime or owner.freed or getattr(owner, "adopted", True):
        return None
    offset = src.data.ptr - owner.ptr
    if offset < 0 or offset + src.nbytes > owner.size:
        return None
    try:
        # ordered after the block's own stream (where CuPy made the array);
        # the buffer stays locked until that DeviceMemory is collected
        buf = adopt(owner)
    except (ValueError, TypeError):
        return None
    return Leaf(buf, offset, src.nbytes, src.shape, src.dtype, src.strides, kind, adopted=True)


def _free_quietly(buf):
    try:
        buf.free()
    except Exception:
        pass


def leaves_of(tree):
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
