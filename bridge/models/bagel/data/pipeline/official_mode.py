"""``data.order: official``: the official BAGEL loader's batch stream, emulated in-process with exact resume.

The official training script (spec bagel_packer.md §11.1–§11.2) wraps one ``PackedDataset`` in a torch
``DataLoader(num_workers=W)``. Each worker w runs its own ``PackedDataset.__iter__``: its own group
readers over its slice of every group's units (``shard_units``: sort, ``Random(data_seed).shuffle``, the
rank's ``len // world_size`` slice, the worker's ``per_rank // W`` slice reversed), its own packer and
buffer, and its own process-global RNG streams (seeded ``base_seed + w`` / ``_generate_state(base_seed, w)``
with ``base_seed`` the first int64 of ``torch.manual_seed(rank seed)``). The DataLoader delivers batches
in order, so batch k comes from worker ``k % W``.

:class:`OfficialWorkers` holds one ``BagelRNGIterator(BagelPacker([OfficialOrderReader per group]),
rank_seed, worker_id=w)`` chain per emulated worker and takes batches round-robin. Its state is the
round-robin position plus each chain's own state (RNG streams, packer buffer keys, reader cursors).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..state import Stage, StateError
from ..stats import merge_counts

__all__ = ["OfficialWorkers"]

logger = logging.getLogger(__name__)


class OfficialWorkers(Stage):
    """Round-robin over per-worker chains (``source[w]`` = emulated DataLoader worker w), like ``DataLoader``.

    ``next()`` returns the next batch of worker ``next_worker`` and advances it modulo the worker count.
    State: ``source`` (each chain's own tagged state) and ``next_worker`` (int in ``[0, W)``).
    """

    _savable_fields = ("source", "next_worker")

    def __init__(self, workers: Sequence[Any]) -> None:
        if not workers:
            raise ValueError("OfficialWorkers needs at least one worker chain")
        self.source = list(workers)
        self.reset_state()

    def reset_state(self) -> None:
        self.next_worker = 0

    def identity(self) -> dict[str, Any]:
        return {"num_workers": len(self.source)}

    def check_compatible(self, state: dict[str, Any]) -> None:
        value = state["next_worker"]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < len(self.source):
            raise StateError(f"OfficialWorkers: next_worker {value!r} out of range for {len(self.source)} workers")

    def stats(self) -> dict[str, Any]:
        """The packer counters summed over workers (``num_batches``, ``consumed`` per group, ``buffer_len``,
        ``drops``, ``packer_drops``, ``source_drops`` per group, the per-group ``ledger``) and each worker's own
        (``workers``)."""
        per = [w.stats() if callable(getattr(w, "stats", None)) else {} for w in self.source]
        groups = list(per[0].get("source_drops", {})) if per else []
        ledgers = [s.get("ledger", {}) for s in per]
        ledger = {g: {"consumed": sum(int(x[g]["consumed"]) for x in ledgers if g in x),
                      "packed": sum(int(x[g]["packed"]) for x in ledgers if g in x),
                      "dropped": merge_counts([x[g]["dropped"] for x in ledgers if g in x]),
                      "buffered": sum(int(x[g]["buffered"]) for x in ledgers if g in x)} for g in groups}
        return {"num_batches": sum(int(s.get("num_batches", 0)) for s in per),
                "consumed": merge_counts([s.get("consumed", {}) for s in per]),
                "buffer_len": sum(int(s.get("buffer_len", 0)) for s in per),
                "drops": merge_counts([s.get("drops", {}) for s in per]),
                "unused": merge_counts([s.get("unused", {}) for s in per]),
                "packer_drops": merge_counts([s.get("packer_drops", {}) for s in per]),
                "source_drops": {g: merge_counts([s.get("source_drops", {}).get(g, {}) for s in per]) for g in groups},
                "ledger": ledger, "workers": per}

    def __next__(self) -> Any:
        batch = next(self.source[self.next_worker])
        self.next_worker = (self.next_worker + 1) % len(self.source)
        return batch
