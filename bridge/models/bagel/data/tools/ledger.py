"""The exactly-once proof of the elastic order, from what a run leaves behind: every batch's ``data_indexes`` and
the final loader state of every rank (``save_state()`` / the last checkpoint's files).

Per group, the final partition cursors say exactly which (selection position, epoch) reads were *taken* (every
position of the epochs before a partition's cursor, and the first ``cursor`` of its current epoch, in the order of
``elastic_order.PartitionOrder``). Exactly once holds when

* no (position, epoch) is packed twice or both packed and still waiting (packer buffer / carry, handed-over
  keys not yet read), and each of them was taken;
* summed over groups, taken = packed + waiting + dropped (the readers' and the packer's drop counts, which new
  rank 0 carries across resizes).

So every taken read is packed once, dropped with a counted reason, or waiting — never lost, never repeated.
``epoch_complete`` tells whether every partition is past epoch 0 (then epoch 0's taken set is the whole official
selection, so the property covers the epoch exactly).
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..energon.elastic_order import PartitionOrder

__all__ = ["LedgerReport", "check_exactly_once"]


@dataclass
class LedgerReport:
    """The ledger of one run: per group ``taken`` / ``packed`` / ``waiting`` counts, the total of drops, whether
    epoch 0 is complete, and every problem found (empty: exactly once holds)."""

    groups: dict[str, dict[str, int]] = field(default_factory=dict)
    dropped: int = 0
    epoch_complete: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


#: The packer stages a loader state may hold (``packer.strategy`` official / balanced); both keep their waiting
#: samples as ``buffer_keys`` (and ``carry_keys``).
PACKER_STAGES = ("BagelPacker", "BalancedPacker")


def _packer_nodes(obj: Any) -> list[Any]:
    """The packer nodes (either stage of ``PACKER_STAGES``) of a saved state or fingerprint."""
    return [n for stage in PACKER_STAGES for n in _nodes(obj, stage)]


def _nodes(obj: Any, stage: str) -> list[Any]:
    """Every nested ``{"stage": stage, ...}`` dict of a saved state or fingerprint, depth first."""
    out: list[Any] = []
    if isinstance(obj, Mapping):
        if obj.get("stage") == stage:
            out.append(obj)
        for v in obj.values():
            out += _nodes(v, stage)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out += _nodes(v, stage)
    return out


def _cursors(blob: bytes) -> dict[int, tuple[int, int]]:
    rows = np.frombuffer(zlib.decompress(blob), dtype=np.int64).reshape(-1, 3).cumsum(axis=0)
    return {int(p): (int(e), int(c)) for p, e, c in rows}


def _identity(key: Any) -> tuple[int, int]:
    (_tag, _d, _i, j, e, _p), _choices = key
    return int(j), int(e)


def check_exactly_once(batch_indexes: Iterable[Mapping[str, Any]], final_states: Sequence[Mapping[str, Any]]
                       ) -> LedgerReport:
    """Check the exactly-once property (module docstring) of an elastic-order run.

    ``batch_indexes``: the ``data_indexes`` dict of every packed sample of every batch of every rank over the whole
    run (all resize generations, only batches the trainer consumed before each restart's checkpoint);
    ``final_states``: the final loader state of every rank of the last world. Raises ValueError for states that
    are not elastic-order loader states.
    """
    report = LedgerReport()
    first = final_states[0]
    packer_fp = _packer_nodes(first["fingerprint"]["upstream"])
    if not packer_fp:
        raise ValueError(f"check_exactly_once: the states hold no packer ({' / '.join(PACKER_STAGES)})")
    groups = list(packer_fp[0]["group_names"])
    reader_fps = packer_fp[0]["sources"]
    if any(fp.get("stage") != "ElasticGroupReader" for fp in reader_fps):
        raise ValueError("check_exactly_once: the states are not of data.order elastic")
    orders = {g: PartitionOrder(fp["num_positions"], fp["partitions"], fp["seed"], fp["group"], fp["chunk"])
              for g, fp in zip(groups, reader_fps)}
    taken: dict[str, set[tuple[int, int]]] = {g: set() for g in groups}
    waiting: dict[str, Counter] = {g: Counter() for g in groups}
    complete = True
    for state in final_states:
        packer = _packer_nodes(state["upstream"])[0]["state"]
        report.dropped += sum(packer["drops"]["state"]["counts"].values())
        for group_index, key in packer["buffer_keys"] + [list(e) for e in packer.get("carry_keys", [])]:
            waiting[groups[group_index]][_identity(key)] += 1
        for g, source in zip(groups, packer["sources"]):
            reader = source["state"]
            report.dropped += sum(reader["drops"]["state"]["counts"].values())
            for key in reader["pending"]:
                waiting[g][_identity(key)] += 1
            order = orders[g]
            for p, (epoch, cursor) in _cursors(reader["cursors"]).items():
                complete &= epoch >= 1
                for e in range(epoch):
                    taken[g].update((int(j), e) for j in order.positions(p, e))
                taken[g].update((int(j), epoch) for j in order.positions(p, epoch, cursor))
    packed: dict[str, Counter] = {g: Counter() for g in groups}
    for index in batch_indexes:
        packed[index["dataset_name"]][(int(index["position"]), int(index["epoch"]))] += 1
    total_taken = total_kept = 0
    for g in groups:
        seen = packed[g] + waiting[g]
        twice = [k for k, n in seen.items() if n > 1]
        if twice:
            report.problems.append(f"group {g!r}: {len(twice)} reads packed or waiting more than once, e.g. "
                                   f"(position, epoch) {sorted(twice)[:3]}")
        untaken = [k for k in seen if k not in taken[g]]
        if untaken:
            report.problems.append(f"group {g!r}: {len(untaken)} packed/waiting reads were never taken, e.g. "
                                   f"{sorted(untaken)[:3]}")
        n_packed, n_waiting = sum(packed[g].values()), sum(waiting[g].values())
        report.groups[g] = {"taken": len(taken[g]), "packed": n_packed, "waiting": n_waiting,
                            "selection": orders[g].num_positions}
        total_taken += len(taken[g])
        total_kept += n_packed + n_waiting
    if total_taken != total_kept + report.dropped:
        report.problems.append(f"taken {total_taken} != packed + waiting {total_kept} + dropped {report.dropped}: "
                               f"{total_taken - total_kept - report.dropped} reads unaccounted for")
    report.epoch_complete = complete
    return report
