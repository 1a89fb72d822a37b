"""The exactly-once proof of the elastic order, from what a run leaves behind: every batch's ``data_indexes`` and
the final loader state of every rank (``save_state()`` / the last checkpoint's files).

Per group, the final plans of every rank say exactly which (selection position, epoch) reads were *taken*: every
block (a partition in an epoch) that no rank still holds below the largest tail, and the first ``cursor`` reads of
each open or queued block (``energon.readers.elastic.reads_taken``). Exactly once holds when

* no (position, epoch) is packed twice or both packed and still waiting (packer buffer / carry, handed-over
  keys not yet read), and each of them was taken;
* summed over groups, taken = packed + waiting + dropped (the readers' and the packer's drop counts, which new
  rank 0 carries across resizes).

So every taken read is packed once, dropped with a counted reason, or waiting — never lost, never repeated.
``complete_groups`` names the groups whose every block of epoch 0 is finished (then epoch 0's taken set is the whole
official selection, so the property covers that epoch exactly); ``epoch_complete``: all of them. A group some rank
rarely reads (a non-mandatory group on a rank whose packs fill up with mandatory samples) can keep an epoch-0 block
open for long while other ranks read later epochs: each (position, epoch) is still read once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..energon.readers.elastic import reads_taken
from ..energon.readers.partitions import PartitionOrder

__all__ = ["LedgerReport", "check_exactly_once"]


@dataclass
class LedgerReport:
    """The ledger of one run: per group ``taken`` / ``packed`` / ``waiting`` counts, the total of drops, whether
    epoch 0 is complete, and every problem found (empty: exactly once holds)."""

    groups: dict[str, dict[str, int]] = field(default_factory=dict)
    dropped: int = 0
    complete_groups: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def epoch_complete(self) -> bool:
        """Every group's epoch 0 is finished."""
        return len(self.complete_groups) == len(self.groups)

    @property
    def ok(self) -> bool:
        return not self.problems


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
    packer_fp = _nodes(first["fingerprint"]["source"], "BagelPacker")
    if not packer_fp:
        raise ValueError("check_exactly_once: the states hold no BagelPacker")
    groups = list(packer_fp[0]["group_names"])
    plan_fps = [fp.get("source", {}) for fp in packer_fp[0]["source"]]
    if any(fp.get("stage") != "ElasticPlan" for fp in plan_fps):
        raise ValueError("check_exactly_once: the states are not of data.order elastic")
    orders = {g: PartitionOrder(fp["num_positions"], fp["partitions"], fp["seed"], g, fp["chunk"])
              for g, fp in zip(groups, plan_fps)}
    taken: dict[str, set[tuple[int, int]]] = {}
    waiting: dict[str, Counter] = {g: Counter() for g in groups}
    plans: dict[str, list[Any]] = {g: [] for g in groups}
    for state in final_states:
        packer = _nodes(state["source"], "BagelPacker")[0]["state"]
        report.dropped += sum(packer["drops"]["state"]["counts"].values())
        for group_index, key in packer["buffer"] + [list(e) for e in packer["carry"]]:
            waiting[groups[group_index]][_identity(key)] += 1
        for g, source in zip(groups, packer["source"]):
            reader = source["state"]
            report.dropped += sum(reader["drops"]["state"]["counts"].values())
            plan = reader["source"]["state"]
            for key in plan["pending"]:
                waiting[g][_identity(key)] += 1
            plans[g].append(plan)
    for g in groups:
        taken[g], done = reads_taken(plans[g], orders[g])
        if done:
            report.complete_groups.append(g)
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
    return report
