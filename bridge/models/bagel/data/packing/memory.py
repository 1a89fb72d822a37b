"""Where the packer's large output tensors live: a pool of warm memory, or shared memory in a producer.

**Warm-memory pool (default).** Each batch holds a few hundred MB of fresh float32 buffers (padded images,
ViT tokens, dense masks). Allocating them new every batch means the kernel maps and zero-fills every page
on first touch, which costs several times the actual writing. So buffers of at least ``POOL_MIN_BYTES``
are carved from reusable blocks (uninitialised ``uint8`` NumPy arrays) and handed out as exact-size tensors
through ``torch.from_numpy`` on a NumPy view of the block made for this buffer alone (the "lease"). The
tensor's storage holds the lease for as long as *any* tensor, view or NumPy array of that memory is alive;
only when the last one is gone is the lease collected and its block returned to the pool
(``weakref.finalize``). A consumer that keeps a batch therefore keeps its memory: nothing is reused while
referenced.

Free blocks kept in the pool are capped at ``pool_limit_bytes`` (default 2 GiB, env
``BAGEL_DATA_POOL_BYTES``; 0 disables pooling); beyond it freed blocks are released to the system.
Free *shared* blocks of a producer have their own, smaller cap (default 512 MiB, env
``BAGEL_DATA_SHM_POOL_BYTES``; 0 disables): they occupy ``/dev/shm``, often a small tmpfs in containers, once
per rank. A producer drops its whole pool before it exits (``release_shared``).

**Shared memory (prefetch producers).** A torch multiprocessing queue would copy every tensor into shared
memory; allocating the large buffers there from the start makes the hand-over a handle exchange. They are
pooled too: with torch's ``file_system`` sharing strategy every segment carries a cross-process reference
count (one per process mapping it, plus one while a pickled handle is in flight). A block is reused only
when that count is 1 (only this producer maps it: the trainer has dropped every tensor of it) *and* no
tensor in this process refers to it (storage use count 1: only the pool). Reading the count relies on
torch's ``RefcountedMapAllocator`` layout (an int 64 bytes before the data), so it is checked once against
``_shared_incref``/``_shared_decref``; if the check fails, shared buffers are simply not pooled.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import math
import mmap
import os
import threading
import weakref

import numpy as np
import torch
import torch.multiprocessing

__all__ = ["POOL_MIN_BYTES", "empty", "pool_stats", "release_shared", "set_pool_limit", "use_shared_memory"]

POOL_MIN_BYTES = 1 << 20  # smaller buffers come from the ordinary allocator (it keeps them warm itself)
_SHARED = False
_LOCK = threading.Lock()
_FREE: list[tuple[int, np.ndarray]] = []  # (capacity bytes, block), sorted by capacity, oldest first
_STATS = {"hits": 0, "misses": 0, "released": 0}
_limit = int(os.environ.get("BAGEL_DATA_POOL_BYTES", str(2 << 30)))
_shm_limit = int(os.environ.get("BAGEL_DATA_SHM_POOL_BYTES", str(512 << 20)))
_SHM_BLOCKS: list[torch.UntypedStorage] = []  # shared-memory blocks owned by this process's pool
_INHERITED: list[torch.UntypedStorage] = []  # shared blocks of a parent process: kept alive, never reused
_shm_refcount_ok: bool | None = None  # layout self-check result (None: not checked yet)
logger = logging.getLogger(__name__)


def _reset_lock_in_child() -> None:
    # A thread of the parent may have held the lock at fork (e.g. a finalizer returning a block); the child
    # has no such thread, so it starts with a fresh lock. Shared blocks of the parent's pool are the *same*
    # memory in the child (a fork keeps shared mappings), so the child must never reuse them — two producers
    # forked from one trainer would write into each other's batches. They stay referenced (dropping inherited
    # shared storages here would decrement their cross-process counts for the parent) but leave the pool.
    global _LOCK
    _LOCK = threading.Lock()
    _INHERITED.extend(_SHM_BLOCKS)
    _SHM_BLOCKS.clear()


os.register_at_fork(after_in_child=_reset_lock_in_child)


def use_shared_memory(enabled: bool) -> None:
    """Allocate the packer's large buffers in shared memory in this process (prefetch producers only)."""
    global _SHARED
    _SHARED = bool(enabled)


def release_shared() -> None:
    """Producer, before it exits: drop the pool's shared blocks. A process ends with ``os._exit`` and never
    decrements the cross-process counts of what it still holds, so without this every pooled segment outlived
    the producer until the trainer exited (a test suite of producers filled /dev/shm). A block the trainer still
    uses is unlinked when the trainer drops it. Blocks inherited from a parent are never dropped (see
    ``_reset_lock_in_child``)."""
    with _LOCK:
        _SHM_BLOCKS.clear()


def set_pool_limit(nbytes: int, shared_nbytes: int | None = None) -> None:
    """Cap the bytes of free blocks kept for reuse (0: no pooling; every buffer is newly allocated); free
    shared-memory blocks are capped by ``shared_nbytes`` (unchanged when None)."""
    global _limit, _shm_limit
    with _LOCK:
        _limit = max(0, int(nbytes))
        if shared_nbytes is not None:
            _shm_limit = max(0, int(shared_nbytes))
        _trim_locked()
        _trim_shared_locked(0)


def pool_stats() -> dict[str, int]:
    """Counters: ``hits`` (buffers served from a warm block), ``misses`` (new blocks), ``released`` (blocks
    given back to the system over the limit), ``free_blocks`` / ``free_bytes`` currently pooled."""
    with _LOCK:
        return {**_STATS, "free_blocks": len(_FREE), "free_bytes": sum(c for c, _ in _FREE),
                "shared_blocks": len(_SHM_BLOCKS), "shared_bytes": sum(b.nbytes() for b in _SHM_BLOCKS)}


#: A free block serves a request of at least ``1 / REUSE_SPAN`` of its size. Batches differ a lot: the demo's
#: ``padded_images`` take 85-205 MB and its ViT tokens 20-45 MB from one batch to the next. Each new block costs
#: its first touch (~2 ms per MB on the 2-core development VM: 0.4-1 s over the first batches with a span of
#: 2), while a larger block only holds address space beyond the part a request writes.
REUSE_SPAN = 4


def _capacity(nbytes: int) -> int:
    """Block size for a request: its power of two (at least ``POOL_MIN_BYTES``), so that with ``REUSE_SPAN`` the
    block serves requests from a quarter of that size up to all of it (a batch mix of 85-205 MB takes one
    256 MB block instead of three)."""
    return max(POOL_MIN_BYTES, 1 << max(0, nbytes - 1).bit_length())


def _trim_locked() -> None:
    total = sum(c for c, _ in _FREE)
    while _FREE and total > _limit:
        cap, _ = _FREE.pop(0)  # smallest first: big blocks are the expensive ones to fault in
        total -= cap
        _STATS["released"] += 1


def _give_back(block: np.ndarray) -> None:
    with _LOCK:
        bisect.insort(_FREE, (block.nbytes, block), key=lambda e: e[0])  # after the blocks of its size
        _trim_locked()


def _take(nbytes: int) -> np.ndarray:
    """A free block of at least ``nbytes`` (at most ``REUSE_SPAN`` times as big), or a new one."""
    with _LOCK:
        i = bisect.bisect_left(_FREE, nbytes, key=lambda e: e[0])
        if i < len(_FREE) and _FREE[i][0] <= REUSE_SPAN * nbytes:
            _STATS["hits"] += 1
            return _FREE.pop(i)[1]
        _STATS["misses"] += 1
    return np.empty(_capacity(nbytes), dtype=np.uint8)


def _shared_refcount(storage: torch.UntypedStorage) -> int:
    """Processes mapping this ``file_system`` segment (+1 per handle in flight): RefcountedMapAllocator's
    int header, 64 bytes before the data; -1 where the data does not start 64 bytes into a page (another
    allocator: the header would not be on the data's own, surely mapped, page)."""
    ptr = storage.data_ptr()
    return ctypes.c_int.from_address(ptr - 64).value if ptr % mmap.PAGESIZE == 64 else -1


def _check_refcount_layout() -> bool:
    """True if shared buffers can be pooled: ``file_system`` strategy and a readable segment refcount."""
    global _shm_refcount_ok
    if torch.multiprocessing.get_sharing_strategy() != "file_system":
        return False
    if _shm_refcount_ok is None:
        try:
            probe = torch.UntypedStorage._new_shared(4096)
            first = _shared_refcount(probe)
            probe._shared_incref()
            second = _shared_refcount(probe)
            probe._shared_decref()
            _shm_refcount_ok = (first, second, _shared_refcount(probe)) == (1, 2, 1)
        except Exception:  # noqa: BLE001 - another sharing strategy or layout: just do not pool
            _shm_refcount_ok = False
        if not _shm_refcount_ok:
            logger.info("shared-memory buffers are not pooled: torch's segment reference count is not readable")
    return _shm_refcount_ok


def _shared_free(block: torch.UntypedStorage) -> bool:
    """Nobody but the pool uses ``block``: no tensor here (use count 1), no other process (refcount 1)."""
    return torch._C._storage_Use_Count(block._cdata) == 1 and _shared_refcount(block) == 1


def _trim_shared_locked(keep: int) -> None:
    """Drop free shared blocks (smallest first) until at most ``_shm_limit - keep`` free bytes remain."""
    free = sorted((b for b in _SHM_BLOCKS if _shared_free(b)), key=lambda b: b.nbytes())
    total = sum(b.nbytes() for b in free)
    while free and total > max(0, _shm_limit - keep):
        block = free.pop(0)
        total -= block.nbytes()
        _SHM_BLOCKS.remove(block)
        _STATS["released"] += 1


def _empty_shared(shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    if nbytes < POOL_MIN_BYTES or _shm_limit <= 0 or not _check_refcount_layout():
        return torch.empty(0, dtype=dtype).set_(torch.UntypedStorage._new_shared(max(nbytes, 1)), 0, shape)
    with _LOCK:
        fits = [b for b in _SHM_BLOCKS if nbytes <= b.nbytes() <= REUSE_SPAN * nbytes and _shared_free(b)]
        if fits:
            block = min(fits, key=lambda b: b.nbytes())
            _STATS["hits"] += 1
        else:
            _STATS["misses"] += 1
            _trim_shared_locked(_capacity(nbytes))
            block = torch.UntypedStorage._new_shared(_capacity(nbytes))
            _SHM_BLOCKS.append(block)
    return torch.empty(0, dtype=dtype).set_(block, 0, shape)


def empty(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uninitialised contiguous CPU tensor of ``shape``/``dtype``: pooled warm memory, or shared memory
    when enabled for this process. The memory is never reused while any view of the tensor is alive."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if _SHARED:
        return _empty_shared(tuple(shape), dtype, nbytes)
    if nbytes < POOL_MIN_BYTES or _limit <= 0:
        return torch.empty(shape, dtype=dtype)
    block = _take(nbytes)
    lease = block[:nbytes]  # a NumPy view object of its own: the tensor storage holds it, nothing else does
    weakref.finalize(lease, _give_back, block).atexit = False
    return torch.from_numpy(lease).view(dtype).view(shape)
