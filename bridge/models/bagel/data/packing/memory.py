"""Where the packer's large output tensors live: a pool of warm memory, or shared memory in a producer.

**Warm-memory pool (default).** Each batch holds a few hundred MB of fresh float32 buffers (padded images,
ViT tokens, dense masks). Allocating them new every batch means the kernel maps and zero-fills every page
on first touch, which costs several times the actual writing. So buffers of at least ``POOL_MIN_BYTES``
are carved from reusable blocks (uninitialised ``uint8`` NumPy arrays) and handed out as exact-size tensors
through ``torch.from_numpy`` on a NumPy view of the block made for this buffer alone (the "lease"). The
tensor's storage holds the lease for as long as *any* tensor, view or NumPy array of that memory is alive;
only when the last one is gone is the lease collected and its block returned to the pool
(``weakref.finalize``). A
consumer that keeps a batch therefore keeps its memory: nothing is reused while referenced.

Free blocks kept in the pool are capped at ``pool_limit_bytes`` (default 2 GiB, env
``BAGEL_DATA_POOL_BYTES``; 0 disables pooling); beyond it freed blocks are released to the system.

**Shared memory (prefetch producers).** A torch multiprocessing queue would copy every tensor into shared
memory; allocating the large buffers there from the start makes the hand-over a handle exchange. These are
not pooled: the producer cannot see when the trainer drops a batch (see README, Performance).
"""

from __future__ import annotations

import bisect
import math
import os
import threading
import weakref

import numpy as np
import torch

__all__ = ["POOL_MIN_BYTES", "empty", "pool_stats", "set_pool_limit", "use_shared_memory"]

POOL_MIN_BYTES = 1 << 20  # smaller buffers come from the ordinary allocator (it keeps them warm itself)
_SHARED = False
_LOCK = threading.Lock()
_FREE: list[tuple[int, int, np.ndarray]] = []  # (capacity bytes, serial, block), sorted by capacity
_STATS = {"hits": 0, "misses": 0, "released": 0}
_serial = 0
_limit = int(os.environ.get("BAGEL_DATA_POOL_BYTES", str(2 << 30)))


def use_shared_memory(enabled: bool) -> None:
    """Allocate the packer's large buffers in shared memory in this process (prefetch producers only)."""
    global _SHARED
    _SHARED = bool(enabled)


def set_pool_limit(nbytes: int) -> None:
    """Cap the bytes of free blocks kept for reuse (0: no pooling; every buffer is newly allocated)."""
    global _limit
    with _LOCK:
        _limit = max(0, int(nbytes))
        _trim_locked()


def pool_stats() -> dict[str, int]:
    """Counters: ``hits`` (buffers served from a warm block), ``misses`` (new blocks), ``released`` (blocks
    given back to the system over the limit), ``free_blocks`` / ``free_bytes`` currently pooled."""
    with _LOCK:
        return {**_STATS, "free_blocks": len(_FREE), "free_bytes": sum(c for c, _, _ in _FREE)}


def _capacity(nbytes: int) -> int:
    """Block size for a request: rounded up to a quarter of its power of two, so similar sizes share blocks."""
    step = max(POOL_MIN_BYTES, 1 << max(0, nbytes.bit_length() - 3))
    return -(-nbytes // step) * step


def _trim_locked() -> None:
    total = sum(c for c, _, _ in _FREE)
    while _FREE and total > _limit:
        cap, _, _ = _FREE.pop(0)  # smallest first: big blocks are the expensive ones to fault in
        total -= cap
        _STATS["released"] += 1


def _give_back(block: np.ndarray) -> None:
    global _serial
    with _LOCK:
        _serial += 1
        bisect.insort(_FREE, (block.nbytes, _serial, block), key=lambda e: (e[0], e[1]))
        _trim_locked()


def _take(nbytes: int) -> np.ndarray:
    """A free block of at least ``nbytes`` (at most twice as big), or a new one."""
    with _LOCK:
        i = bisect.bisect_left(_FREE, nbytes, key=lambda e: e[0])
        if i < len(_FREE) and _FREE[i][0] <= 2 * nbytes:
            _STATS["hits"] += 1
            return _FREE.pop(i)[2]
        _STATS["misses"] += 1
    return np.empty(_capacity(nbytes), dtype=np.uint8)


def empty(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uninitialised contiguous CPU tensor of ``shape``/``dtype``: pooled warm memory, or shared memory
    when enabled for this process. The memory is never reused while any view of the tensor is alive."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if _SHARED:
        storage = torch.UntypedStorage._new_shared(max(nbytes, 1))
        return torch.empty(0, dtype=dtype).set_(storage, 0, shape)
    if nbytes < POOL_MIN_BYTES or _limit <= 0:
        return torch.empty(shape, dtype=dtype)
    block = _take(nbytes)
    lease = block[:nbytes]  # a NumPy view object of its own: the tensor storage holds it, nothing else does
    weakref.finalize(lease, _give_back, block).atexit = False
    return torch.from_numpy(lease).view(dtype).view(shape)
