"""The elastic order of one group: a function of (data seed, epoch, a fixed number of partitions), never of the
DP size or the worker count.

A group's epoch is its official selection (``num_used_data``, ``shuffle_lines``, … as ``selection.manifest_runs``
runs; a run repeated ``r`` times counts ``r`` times) laid out as *selection positions* ``0 .. N-1``: dataset by
dataset, run by run, repetition by repetition. The positions are cut into ``P = min(partitions, N)`` canonical
partitions of contiguous positions (``floor(p N / P) .. floor((p+1) N / P)``, every one non-empty). Within a
partition, an epoch reads chunks of ``chunk`` consecutive positions (locality in the tar shards, like Energon's
``max_samples_per_sequence`` slices) in an order permuted per (seed, group, partition, epoch); the last chunk may
be short.

The endless stream of a group is the sequence of *blocks* ``v = 0, 1, 2, ...``: block ``v`` is partition
``p = v mod P`` read in epoch ``e = v // P`` (:func:`block`). Which rank reads which block is the plan's business
(``readers.elastic``); what a block holds, and in which order, depends only on (seed, group, p, e): so a block's
stream is reproducible on any topology, and a resize only hands blocks (with their cursors) to new owners. Memory:
O(runs) for the layout, O(N / (P · chunk)) per block being read; no per-row object (the scale rule).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["DEFAULT_CHUNK", "GroupLayout", "PartitionOrder", "block"]

#: Consecutive selection positions read together inside a partition (Energon reads 100-sample slices too).
DEFAULT_CHUNK = 100
#: Chunk permutations kept per group (one per block a rank reads at once, at most its open blocks plus one).
_CACHE_BLOCKS = 16384


@dataclass(frozen=True)
class GroupLayout:
    """The selection positions of one group: which (dataset, sample index) each position reads.

    ``runs[d]``: dataset ``d``'s selection as ``(start, end, repetitions)`` sample-index runs. Raises ValueError
    for an empty selection.
    """

    runs: Sequence[Sequence[tuple[int, int, int]]]
    dataset: np.ndarray = field(init=False, repr=False)   # int32 (R,): dataset of each expanded run
    start: np.ndarray = field(init=False, repr=False)     # int64 (R,): first sample index of each expanded run
    offset: np.ndarray = field(init=False, repr=False)    # int64 (R + 1,): first position of each expanded run

    def __post_init__(self) -> None:
        expanded = [(d, int(s), int(e) - int(s)) for d, runs in enumerate(self.runs) for s, e, reps in runs
                    for _ in range(int(reps)) if e > s]
        if not expanded:
            raise ValueError("the group's selection is empty")
        ds, starts, lengths = zip(*expanded)
        object.__setattr__(self, "dataset", np.asarray(ds, dtype=np.int32))
        object.__setattr__(self, "start", np.asarray(starts, dtype=np.int64))
        object.__setattr__(self, "offset", np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]))

    @property
    def num_positions(self) -> int:
        """N: selection positions in one epoch (samples, repetitions counted)."""
        return int(self.offset[-1])

    def positions_of(self, dataset: int) -> int:
        """Selection positions of dataset ``dataset`` in one epoch (repetitions counted)."""
        return int(np.diff(self.offset)[self.dataset == int(dataset)].sum())

    def coordinate(self, position: int) -> tuple[int, int]:
        """``(dataset index, sample index)`` read at selection ``position`` (0 <= position < N)."""
        k = int(np.searchsorted(self.offset, position, side="right")) - 1
        return int(self.dataset[k]), int(self.start[k] + (position - self.offset[k]))


class PartitionOrder:
    """Where each partition of a group reads in each epoch (see the module docstring).

    ``num_positions``: N; ``partitions``: the configured count (``P = min(partitions, N)`` are used);
    ``seed``: the data seed; ``group``: the group name (part of the permutation seed).
    """

    def __init__(self, num_positions: int, partitions: int, seed: int, group: str, chunk: int = DEFAULT_CHUNK) -> None:
        if num_positions <= 0 or partitions <= 0 or chunk <= 0:
            raise ValueError(f"PartitionOrder needs positive sizes, got N={num_positions}, partitions={partitions}, "
                             f"chunk={chunk}")
        self.num_positions, self.chunk = int(num_positions), int(chunk)
        self.num_partitions = min(int(partitions), self.num_positions)
        self.seed, self.group = int(seed), str(group)
        key = hashlib.sha256(f"bagel-elastic-order|{group}".encode()).digest()[:8]
        self._group_key = int.from_bytes(key, "big") >> 1  # 63 bits: the same on every machine and Python
        #: (partition, epoch) -> (chunk permutation, cumulative chunk lengths), for the blocks being read (bounded)
        self._cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def bounds(self, p: int) -> tuple[int, int]:
        """First and one-past-last selection position of partition ``p``."""
        n, k = self.num_positions, self.num_partitions
        if not 0 <= p < k:
            raise IndexError(f"partition {p} out of range ({k} partitions)")
        return p * n // k, (p + 1) * n // k

    def size(self, p: int) -> int:
        """Positions in partition ``p`` (>= 1)."""
        a, b = self.bounds(p)
        return b - a

    def _chunks(self, p: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        cached = self._cache.get((p, epoch))
        if cached is not None:
            return cached
        size = self.size(p)
        n_chunks = -(-size // self.chunk)
        perm = np.random.default_rng([self.seed & (2**63 - 1), self._group_key, p, epoch]).permutation(n_chunks)
        lengths = np.full(n_chunks, self.chunk, dtype=np.int64)
        lengths[-1] = size - self.chunk * (n_chunks - 1)
        cum = np.cumsum(lengths[perm])
        if len(self._cache) >= _CACHE_BLOCKS:  # blocks are read a few at a time per slot: drop the oldest entry
            del self._cache[next(iter(self._cache))]
        self._cache[(p, epoch)] = (perm, cum)
        return perm, cum

    def position(self, p: int, epoch: int, cursor: int) -> int:
        """The selection position partition ``p`` reads at ``cursor`` (0 <= cursor < size) of ``epoch``."""
        if not 0 <= cursor < self.size(p):
            raise IndexError(f"cursor {cursor} out of range for partition {p} of {self.size(p)} positions")
        perm, cum = self._chunks(p, epoch)
        k = int(np.searchsorted(cum, cursor, side="right"))
        into = cursor - (int(cum[k - 1]) if k else 0)
        return self.bounds(p)[0] + int(perm[k]) * self.chunk + into

    def positions(self, p: int, epoch: int, count: int | None = None) -> np.ndarray:
        """The first ``count`` (default: all) positions partition ``p`` reads in ``epoch``, in order (int64)."""
        a, b = self.bounds(p)
        parts = [np.arange(a + int(c) * self.chunk, min(a + (int(c) + 1) * self.chunk, b), dtype=np.int64)
                 for c in self._chunks(p, epoch)[0]]
        return np.concatenate(parts)[:None if count is None else int(count)]


def block(v: int, num_partitions: int) -> tuple[int, int]:
    """``(epoch, partition)`` of block ``v`` of a group whose epoch is cut into ``num_partitions`` partitions."""
    return divmod(int(v), int(num_partitions))
