"""Where the packer's large output tensors live: ordinary memory, or shared memory in a producer process.

A prefetch producer hands batches to the trainer through a torch multiprocessing queue, which would copy every
tensor into shared memory (for BAGEL's padded images that is hundreds of MB per batch). Allocating the large
buffers there from the start makes the hand-over a handle exchange. Process-wide switch, set by the producer.
"""

from __future__ import annotations

import math

import torch

__all__ = ["empty", "use_shared_memory"]

_SHARED = False


def use_shared_memory(enabled: bool) -> None:
    """Allocate the packer's large buffers in shared memory in this process (prefetch producers only)."""
    global _SHARED
    _SHARED = bool(enabled)


def empty(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uninitialised tensor, in shared memory when enabled for this process."""
    if not _SHARED:
        return torch.empty(shape, dtype=dtype)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    storage = torch.UntypedStorage._new_shared(max(nbytes, 1))
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)
