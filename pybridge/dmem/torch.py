"""dmem as PyTorch's CUDA allocator (torch.cuda.memory.CUDAPluggableAllocator).

    import torch, dmem.torch
    dmem.torch.use_dmem_for_torch()   # before PyTorch's first CUDA allocation

Tensors then take their memory from the process-wide dmem runtime of their
device (``dmem.default_runtime(device)``), through the C symbols
``dmem_torch_alloc`` / ``dmem_torch_free`` of the very libdmem this package
has loaded: the same runtime as the Numba and CuPy hooks and Python code, one
device limit for all, spillable buffers spilled to make room. Allocation is
in the tensor's stream order and frees go back on the stream PyTorch names.

Limits (PyTorch's, for any pluggable allocator):

- Set it before PyTorch's first CUDA allocation: once its caching allocator
  has been used, ``change_current_allocator`` refuses to swap it.
- ``torch.cuda.memory_stats()``, ``memory_allocated()`` and friends do not
  cover it (they report PyTorch's own caching allocator); read
  ``dmem.default_runtime(device).stats()`` (``raw_used``, ``device_used``,
  ``device_limit``) instead. ``torch.cuda.empty_cache()`` does nothing to it.
- CUDA graphs capture and ``torch.cuda.MemPool`` work only with PyTorch's own
  allocator.

Importing this module imports neither PyTorch nor CUDA; ``allocator()``
raises ImportError naming PyTorch when it is missing.
"""

from . import _dmem

__all__ = ["allocator", "library_path", "use_dmem_for_torch"]

_alloc = None


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


def use_dmem_for_torch():
    """torch.cuda.memory.change_current_allocator(dmem.torch.allocator())."""
    alloc = allocator()
    import torch

    torch.cuda.memory.change_current_allocator(alloc)
