"""dmem as PyTorch's CUDA memory (torch.cuda.MemPools over dmem's allocator).

    import torch, dmem.torch
    dmem.torch.use_dmem_for_torch()

Tensors then take their memory from the process-wide dmem runtime of their
device (``dmem.default_runtime(device)``), through the C symbols
``dmem_torch_alloc`` / ``dmem_torch_free`` of the very libdmem this package
has loaded: the same runtime as the Numba and CuPy hooks and Python code, one
device limit for all, spillable buffers spilled to make room.

How: a ``torch.cuda.MemPool`` over a ``CUDAPluggableAllocator`` of those
symbols, to which every allocation of the device is routed, from every
thread (``torch._C._cuda_beginAllocateToPool``). PyTorch's own caching
allocator stays in front: it asks dmem for segments, checks each answer,
and when dmem cannot make room (spilling whatever it can) raises
``torch.OutOfMemoryError``, after which the process goes on as usual (the
next smaller allocation works). The error's message says how dmem's limit
is used (raw, locked, pinned, spillable, free). A plain pluggable allocator
(``change_current_allocator``) does not check for NULL: a tensor at address
0 and an illegal memory access at its first use; dmem does not use it.

What follows from PyTorch's caching (read before relying on it):

- Freed tensors go back to PyTorch's pool, not to dmem: the pool keeps its
  segments for reuse, and dmem counts them as raw (``raw_used``), not as
  room for spillable buffers. ``dmem.torch.empty_cache()`` starts a new
  pool and gives the old one's free segments back to dmem.
- ``torch.cuda.memory_allocated()`` / ``memory_stats()`` cover it again.
- It may be called at any time (also after PyTorch allocated on its own:
  those allocations stay where they are).

Global or per pool: ``use_dmem_for_torch()`` sends every CUDA allocation of
the device, from every thread, to dmem: one limit for the whole program,
nothing to change in the model code. ``dmem.torch.mempool(device)`` instead
gives a ``torch.cuda.MemPool`` over dmem for the allocations a program
chooses::

    pool = dmem.torch.mempool(0)
    with torch.cuda.use_mem_pool(pool):
        x = torch.empty(n, device="cuda:0")     # from dmem
    y = torch.empty(n, device="cuda:0")         # PyTorch's own allocator

Use the pool to put only some tensors (the large, long-lived ones; a CUDA
graph's private memory, ``torch.cuda.graph(g, pool=pool.id)``) under dmem's
limit while the rest keeps PyTorch's allocator and its speed, or when
another library owns the global routing. Use the global routing when every
byte must be counted. Both on one device at once is not tested: pick one.

Needs PyTorch 2.8 or later (MemPool, routing of every thread); with an older
one ``use_dmem_for_torch`` raises RuntimeError. Importing this module imports
neither PyTorch nor CUDA; ``allocator()`` raises ImportError naming PyTorch
when it is missing.
"""

import threading

from . import _dmem

__all__ = ["allocator", "empty_cache", "library_path", "mempool", "oom_message",
           "use_dmem_for_torch"]

_alloc = None
_pools = {}  # device ordinal -> the torch.cuda.MemPool allocations go to
_observer = False
_torch_empty_cache = None  # PyTorch's own torch.cuda.empty_cache, once replaced
_mu = threading.RLock()


def library_path():
    """The file of the libdmem loaded in this process (what PyTorch dlopens)."""
    return _dmem._library_path()


def allocator():
    """A torch.cuda.memory.CUDAPluggableAllocator over dmem_torch_alloc /
    dmem_torch_free (the same object on every call)."""
    global _alloc
    if _alloc is None:
        try:
            from torch.cuda.memory import CUDAPluggableAllocator
        except ImportError as e:
            raise ImportError(f"dmem.torch needs PyTorch (the package 'torch'): {e}") from e
        _alloc = CUDAPluggableAllocator(library_path(), "dmem_torch_alloc", "dmem_torch_free")
    return _alloc


def _api(torch):
    missing = [n for n in ("_cuda_beginAllocateToPool", "_cuda_endAllocateToPool",
                           "_cuda_releasePool", "_cuda_attach_out_of_memory_observer")
               if not hasattr(torch._C, n)]
    if not hasattr(torch.cuda, "MemPool"):
        missing.append("torch.cuda.MemPool")
    if missing:
        raise RuntimeError(f"dmem.torch needs PyTorch 2.8 or later (torch {torch.__version__} "
                           f"lacks {', '.join(missing)})")


def _devices(torch, device):
    if device is None:
        return list(range(torch.cuda.device_count()))
    d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"device must be a CUDA device, not {device!r}")
    return [d.index if d.index is not None else torch.cuda.current_device()]


def _new_pool(torch, d):
    """A new torch.cuda.MemPool of device d over dmem's allocator."""
    with torch.cuda.device(d):
        return torch.cuda.MemPool(allocator().allocator())


def _route(torch, d):
    """A new pool over dmem for device d, every allocation of d going to it."""
    pool = _new_pool(torch, d)
    torch._C._cuda_beginAllocateToPool(d, pool.id)
    return pool


def mempool(device=None):
    """A new ``torch.cuda.MemPool`` of device (an ordinal, "cuda:N" or a
    torch.device; None: the current device) whose segments are raw
    allocations of ``dmem.default_runtime(device)``. Only what is allocated
    inside ``with torch.cuda.use_mem_pool(pool):`` (on the thread that
    entered it), or by a CUDA graph captured with ``pool=pool.id``, comes
    from it; everything else stays PyTorch's. PyTorch checks each segment
    dmem gives: when dmem cannot make room (after spilling what it can),
    the allocation raises ``torch.OutOfMemoryError``. Freed tensors go
    back to the pool, which keeps its segments until the pool is
    released (its last reference gone and its tensors freed) or
    ``torch.cuda.empty_cache()`` runs. Raises ImportError without PyTorch,
    RuntimeError when PyTorch has no ``torch.cuda.MemPool`` (before 2.8),
    ValueError for a device that is no CUDA device."""
    allocator()  # ImportError naming PyTorch when it is missing
    import torch

    if not hasattr(torch.cuda, "MemPool"):
        raise RuntimeError(f"dmem.torch.mempool needs PyTorch 2.8 or later (torch "
                           f"{torch.__version__} has no torch.cuda.MemPool)")
    if device is None:
        d = torch.cuda.current_device()
    else:
        d = _devices(torch, device)[0]
    return _new_pool(torch, d)


def oom_message(device, nbytes):
    """What dmem's out-of-memory error says for nbytes on device: how the
    device limit of dmem.default_runtime(device) is used."""
    import dmem

    return dmem.default_runtime(device)._oom_message(int(nbytes))


def _on_oom(device, alloc, device_allocated, device_free):
    """PyTorch's out-of-memory observer, called just before it raises
    OutOfMemoryError: for a device routed to dmem, raise it here instead,
    with dmem's account of the limit. Anything going wrong here lets
    PyTorch raise its own."""
    if device not in _pools:
        return None
    try:
        import torch

        msg = (f"CUDA out of memory on device {device}: PyTorch asked dmem for {alloc} bytes "
               f"(dmem.torch); {oom_message(device, alloc)}")
        err = torch.OutOfMemoryError(msg)
    except Exception:
        return None
    raise err


def use_dmem_for_torch(device=None):
    """Route PyTorch's CUDA allocations of device (an ordinal, "cuda:N" or a
    torch.device; None: every device PyTorch sees) to dmem, from every
    thread. Calling it again for a device already routed does nothing.
    torch.cuda.empty_cache is replaced by dmem.torch.empty_cache (PyTorch's
    own aborts the process while allocations are routed to a pool).
    Raises RuntimeError with a PyTorch older than 2.8."""
    global _observer, _torch_empty_cache
    allocator()  # ImportError naming PyTorch when it is missing
    import torch

    _api(torch)
    with _mu:
        for d in _devices(torch, device):
            if d not in _pools:
                _pools[d] = _route(torch, d)
        if not _observer:
            torch._C._cuda_attach_out_of_memory_observer(_on_oom)
            _observer = True
        if _torch_empty_cache is None:
            # PyTorch's empty_cache asserts that no allocation is routed to a
            # pool ("captures_underway.empty() INTERNAL ASSERT FAILED",
            # std::terminate): with every allocation routed to dmem's pool,
            # a plain torch.cuda.empty_cache() would end the process.
            _torch_empty_cache = torch.cuda.empty_cache
            torch.cuda.empty_cache = _empty_cache_all
            torch.cuda.memory.empty_cache = _empty_cache_all


def _empty_cache_all():
    """torch.cuda.empty_cache while dmem.torch routes allocations."""
    empty_cache()


def empty_cache(device=None):
    """Give the free segments PyTorch keeps in dmem's pools back to dmem:
    each routed device gets a new pool (device, if given, must be a CUDA
    device; every routed device is done all the same), the old one is
    released as ``torch.cuda.use_mem_pool`` releases a pool at its exit,
    and PyTorch's empty_cache frees its segments that no tensor uses (the
    others go when their tensors do, at a later empty_cache). Tensors stay
    valid. While it runs (the routing of each device is ended first, since
    PyTorch's empty_cache refuses to run while any allocation is routed to a
    pool), an allocation on another thread comes from PyTorch's own
    allocator. Returns the devices done."""
    import torch

    done, old = [], []
    with _mu:
        if device is not None:
            _devices(torch, device)  # ValueError for a device that is no CUDA device
        # Every routed device, whichever was asked for: PyTorch's empty_cache
        # goes through every device and asserts on any that is routed.
        for d in list(_pools):
            pool = _pools.pop(d)
            torch._C._cuda_endAllocateToPool(d, pool.id)
            torch._C._cuda_releasePool(d, pool.id)
            old.append(pool)
            done.append(d)
        pool = None
        # the old pools' own references go before the cache is emptied, and
        # no allocation is routed while it is (PyTorch asserts both)
        old.clear()
        (_torch_empty_cache or torch.cuda.empty_cache)()
        for d in done:
            _pools[d] = _route(torch, d)
    return done
