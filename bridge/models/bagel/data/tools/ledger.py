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

import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..energon.readers.elastic import reads_taken
from ..energon.readers.partitions import PartitionOrder

__all__ = ["LedgerReport", "check_exactly_once", "format_report", "read_digest_reads"]


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


#: The packer stages a loader state may hold (``packer.strategy`` official / balanced); both keep their waiting
#: samples as ``buffer`` (and ``carry``).
PACKER_STAGES = ("BagelPacker", "BalancedPacker")


def _packer_nodes(obj: Any) -> list[Any]:
    """The packer nodes (either stage of ``PACKER_STAGES``) of a saved state or fingerprint."""
    return _nodes(obj, *PACKER_STAGES)


def _nodes(obj: Any, *stages: str) -> list[Any]:
    """Every nested ``{"stage": stage, ...}`` dict (``stage`` one of ``stages``) of a saved state or fingerprint,
    depth first."""
    if isinstance(obj, Mapping):
        own = [obj] if obj.get("stage") in stages else []
        return own + [n for v in obj.values() for n in _nodes(v, *stages)]
    return [n for v in obj for n in _nodes(v, *stages)] if isinstance(obj, (list, tuple)) else []


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
    packer_fp = _packer_nodes(final_states[0]["fingerprint"]["source"])
    if not packer_fp:
        raise ValueError(f"check_exactly_once: the states hold no packer ({' / '.join(PACKER_STAGES)})")
    groups = list(packer_fp[0]["group_names"])
    plan_fps = [fp.get("source", {}) for fp in packer_fp[0]["source"]]
    if any(fp.get("stage") != "ElasticPlan" for fp in plan_fps):
        raise ValueError("check_exactly_once: the states are not of data.order elastic")
    orders = {g: PartitionOrder(fp["num_positions"], fp["partitions"], fp["seed"], g, fp["chunk"])
              for g, fp in zip(groups, plan_fps)}
    waiting: dict[str, Counter] = {g: Counter() for g in groups}
    plans: dict[str, list[Any]] = {g: [] for g in groups}
    for state in final_states:
        packer = _packer_nodes(state["source"])[0]["state"]
        report.dropped += sum(packer["drops"]["state"]["counts"].values())
        for group_index, key in packer["buffer"] + [list(e) for e in packer["carry"]]:
            waiting[groups[group_index]][_identity(key)] += 1
        for g, source in zip(groups, packer["source"]):
            reader = source["state"]
            report.dropped += sum(reader["drops"]["state"]["counts"].values())
            plan = reader["source"]["state"]
            waiting[g].update(_identity(key) for key in plan["pending"])
            plans[g].append(plan)
    packed: dict[str, Counter] = {g: Counter() for g in groups}
    for index in batch_indexes:
        packed[index["dataset_name"]][(int(index["position"]), int(index["epoch"]))] += 1
    for g in groups:
        taken, done = reads_taken(plans[g], orders[g])
        if done:
            report.complete_groups.append(g)
        seen = packed[g] + waiting[g]
        twice = [k for k, n in seen.items() if n > 1]
        if twice:
            report.problems.append(f"group {g!r}: {len(twice)} reads packed or waiting more than once, e.g. "
                                   f"(position, epoch) {sorted(twice)[:3]}")
        untaken = [k for k in seen if k not in taken]
        if untaken:
            report.problems.append(f"group {g!r}: {len(untaken)} packed/waiting reads were never taken, e.g. "
                                   f"{sorted(untaken)[:3]}")
        report.groups[g] = {"taken": len(taken), "packed": packed[g].total(), "waiting": waiting[g].total(),
                            "selection": orders[g].num_positions}
    total_taken = sum(c["taken"] for c in report.groups.values())
    total_kept = sum(c["packed"] + c["waiting"] for c in report.groups.values())
    if total_taken != total_kept + report.dropped:
        report.problems.append(f"taken {total_taken} != packed + waiting {total_kept} + dropped {report.dropped}: "
                               f"{total_taken - total_kept - report.dropped} reads unaccounted for")
    return report


def read_digest_reads(paths: Sequence[str | os.PathLike], *, up_to_step: int | None = None) -> list[dict[str, Any]]:
    """The packed samples' ``{"dataset_name", "position", "epoch"}`` from the job's digest logs (``train.digest_log``,
    one JSON row per batch per rank, with ``reads`` under the elastic order), in file order.

    One row per (DP size, DP rank, step, micro-batch) is kept, the last one (the TP / PP / CP peers of a DP replica
    log the same batch; a run restarted on the same world from a checkpoint logs the steps after it again); rows
    after ``up_to_step`` (the checkpoint the final states come from) are left out. Raises ValueError naming the file
    and line of a row that is not a digest row, or of a log without any ``reads`` (not the elastic order).
    """
    rows: dict[tuple[int, int, int, int], list[dict[str, Any]]] = {}
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    key = (int(row["dp_size"]), int(row["dp"]), int(row["step"]), int(row["micro"]))
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}:{n}: not a digest row of the job (train.digest_log): "
                                     f"{type(exc).__name__}: {exc}") from None
                if up_to_step is not None and key[2] > up_to_step:
                    continue
                rows.pop(key, None)  # the last occurrence wins, in file order
                rows[key] = [{"dataset_name": g, "position": int(j), "epoch": int(e)}
                             for g, j, e in row.get("reads", ())]
    reads = [r for batch in rows.values() for r in batch]
    if rows and not reads:
        raise ValueError(f"{', '.join(map(str, paths))}: no row records 'reads' (only data.order: elastic logs them)")
    return reads


def format_report(report: LedgerReport) -> str:
    """The report as text: one line per group, the drops, the verdict and every problem."""
    lines = [f"{'group':<16} {'selection':>9} {'taken':>7} {'packed':>7} {'waiting':>7}  epoch 0"]
    for g, c in report.groups.items():
        lines.append(f"{g:<16} {c['selection']:>9} {c['taken']:>7} {c['packed']:>7} {c['waiting']:>7}  "
                     f"{'complete' if g in report.complete_groups else 'open'}")
    lines.append(f"dropped (counted with a reason): {report.dropped}")
    lines += (["exactly once: yes (every taken read packed once, dropped with a reason, or waiting)"] if report.ok
              else [f"exactly once: NO ({len(report.problems)} problems)", *(f"  - {p}" for p in report.problems)])
    return "\n".join(lines)
