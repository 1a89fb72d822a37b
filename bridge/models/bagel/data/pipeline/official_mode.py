"""``data.order: official``: the official BAGEL loader's batch stream, emulated in-process with exact resume.

The official training script (spec bagel_packer.md §11.1–§11.2) wraps one ``PackedDataset`` in a torch
``DataLoader(num_workers=W)``. Each worker w runs its own ``PackedDataset.__iter__``: its own group
readers over its slice of every group's units (``shard_units``: sort, ``Random(data_seed).shuffle``, the
rank's ``len // world_size`` slice, the worker's ``per_rank // W`` slice reversed), its own packer and
buffer, and its own process-global RNG streams (seeded ``base_seed + w`` / ``_generate_state(base_seed, w)``
with ``base_seed`` the first int64 of ``torch.manual_seed(rank seed)``). The DataLoader delivers batches
in order, so batch k comes from worker ``k % W``.

:class:`OfficialWorkers` holds one ``BagelRNGIterator(BagelPacker([GroupReader with an OfficialPlan per group]),
rank_seed, worker_id=w)`` chain per emulated worker and takes batches round-robin. Its state is the
round-robin position plus each chain's own state (RNG streams, packer buffer keys, reader cursors).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..state import Stage, StateError
from ..stats import merge_counts

__all__ = ["OfficialWorkers"]


class OfficialWorkers(Stage):
    """Round-robin over per-worker chains (``source[w]`` = emulated DataLoader worker w), like ``DataLoader``.

    ``next()`` returns the next batch of worker ``next_worker`` and advances it modulo the worker count. State:
    ``source`` (each chain's own tagged state) and ``next_worker`` (int in ``[0, W)``)."""

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
        """The packer counters summed over workers (``num_batches``, ``consumed`` per group, ``buffer_len``, ``drops``,
        ``packer_drops``, ``source_drops`` per group, the per-group ``ledger``) and each worker's own (``workers``)."""
        per = [w.stats() if callable(getattr(w, "stats", None)) else {} for w in self.source]
        groups = list(per[0].get("source_drops", {})) if per else []
        rows = {g: [s["ledger"][g] for s in per if g in s.get("ledger", {})] for g in groups}
        ledger = {g: {k: merge_counts([r[k] for r in rs]) if k == "dropped" else sum(int(r[k]) for r in rs)
                      for k in ("consumed", "packed", "dropped", "buffered")} for g, rs in rows.items()}
        numbers = ("num_batches", "buffer_len")  # summed; the others are reason / group -> count maps, merged
        out = {k: sum(int(s.get(k, 0)) for s in per) if k in numbers else merge_counts([s.get(k, {}) for s in per])
               for k in ("num_batches", "consumed", "buffer_len", "drops", "unused", "packer_drops")}
        out["source_drops"] = {g: merge_counts([s.get("source_drops", {}).get(g, {}) for s in per]) for g in groups}
        return {**out, "ledger": ledger, "workers": per}

    def __next__(self) -> Any:
        batch = next(self.source[self.next_worker])
        self.next_worker = (self.next_worker + 1) % len(self.source)
        return batch
