"""The packer's share of an elastic resize: the packer states of ALL old ranks -> the packer state of ONE new rank.

Pure data (saved state dicts in, a state dict out; no live objects), used through ``BagelPacker.resize_state``.
The rule (``docs/packing_ledger.md``):

* the new rank's buffer and carry start empty: every old rank's buffered and carried samples are handed to
  their group's source instead — ``ctx.resize([old["sources"][g] for old in olds], handover=keys)`` with
  ``keys`` the group's restore keys in old-rank order, and within a rank buffer order then carry order; the
  source decides which of them the new rank yields (first, before its own stream);
* ledger conservation across the world: new rank 0 carries the sums of the old ranks' counters (``drops``,
  ``num_batches``, ``packed``, per-group drops) and ``consumed = sum(old consumed) - sum(old buffered)`` per
  group (the handed-over samples are consumed again by their new owner); every other new rank starts at zero.
  Summed over the new world, ``consumed == packed + dropped + buffered`` therefore still holds.

Raises ``StateError`` (one line) when the old states do not fit together (groups, sources, fields).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..state import StateError
from ..stats import merge_counts

__all__ = ["handover_keys", "resize_packer_state"]

_WHERE = "BagelPacker.resize_state"


def _check(fields: Sequence[str], olds: Any) -> list[str]:
    """The old ranks' common group names; StateError naming the first old rank that does not fit rank 0."""
    if not isinstance(olds, (list, tuple)) or not olds:
        raise StateError(f"{_WHERE}: needs the packer states of all old ranks (a non-empty list), got {olds!r:.80}")
    for i, old in enumerate(olds):
        if not isinstance(old, dict) or set(old) != set(fields):
            got = sorted(old) if isinstance(old, dict) else type(old).__name__
            raise StateError(f"{_WHERE}: old rank {i}'s state has fields {got}, a BagelPacker state has "
                             f"{list(fields)} (saved by another version, or not a packer state)")
    names = list(olds[0]["groups"])
    tags = [s.get("stage") if isinstance(s, dict) else None for s in olds[0]["sources"]]
    for i, old in enumerate(olds):
        if list(old["groups"]) != names:
            raise StateError(f"{_WHERE}: old rank {i} has groups {list(old['groups'])}, old rank 0 has {names}: "
                             "the old ranks ran different configs; resume with the config they were saved with")
        per_group = {"sources": old["sources"], "consumed": old["consumed"], "packed": old["packed"],
                     "group_drops": old["group_drops"]}
        for field, value in per_group.items():
            if not isinstance(value, list) or len(value) != len(names):
                n = len(value) if isinstance(value, list) else type(value).__name__
                raise StateError(f"{_WHERE}: old rank {i} has {n} {field} entries for {len(names)} groups {names}")
        got = [s.get("stage") if isinstance(s, dict) else None for s in old["sources"]]
        if got != tags:
            raise StateError(f"{_WHERE}: old rank {i}'s group sources are {got}, old rank 0's are {tags}: "
                             "the old ranks were built differently")
        for field in ("buffer_keys", "carry_keys"):
            bad = [e for e in old[field] if not (isinstance(e, (list, tuple)) and len(e) == 2
                                                 and isinstance(e[0], int) and 0 <= e[0] < len(names))]
            if bad:
                raise StateError(f"{_WHERE}: old rank {i}'s {field} has entries {bad[:3]} that name no group of "
                                 f"{names}")
    return names


def _drop_counts(old: dict[str, Any], i: int) -> dict[str, int]:
    drops = old["drops"]
    if not (isinstance(drops, dict) and drops.get("stage") == "DropCounter" and isinstance(drops.get("state"), dict)):
        raise StateError(f"{_WHERE}: old rank {i}'s drops are not a saved DropCounter: {drops!r:.80}")
    return drops["state"].get("counts", {})


def handover_keys(olds: Sequence[dict[str, Any]], group: int) -> list[Any]:
    """The restore keys of ``group``'s buffered and carried samples: old-rank order, buffer order, carry last
    (per rank)."""
    return [key for old in olds for field in ("buffer_keys", "carry_keys") for g, key in old[field] if g == group]


def resize_packer_state(fields: Sequence[str], olds: Sequence[dict[str, Any]], ctx: Any) -> dict[str, Any]:
    """The packer state (fields ``fields``, ``BagelPacker._savable_fields``) of new rank ``ctx.dp_rank`` of
    ``ctx.dp_size`` from ``olds`` (every old rank's packer state, old-rank order), by the module's rule.

    ``ctx.resize(tagged_olds, handover)`` resizes one group's source states (``{"stage", "state"}`` each) and
    returns the new tagged state. Raises ``StateError`` when the olds disagree on groups or sources.
    """
    names = _check(fields, olds)
    rank, size = int(ctx.dp_rank), int(ctx.dp_size)
    if not 0 <= rank < size:
        raise StateError(f"{_WHERE}: new dp_rank {rank} is out of range for dp_size {size}")
    n = len(names)
    first = rank == 0
    waiting = [[0] * n for _ in olds]
    for i, old in enumerate(olds):
        for g, _ in (*old["buffer_keys"], *old["carry_keys"]):
            waiting[i][g] += 1

    def summed(field: str) -> list[int]:
        return [sum(int(old[field][g]) for old in olds) if first else 0 for g in range(n)]

    consumed = summed("consumed")
    if first:
        consumed = [c - sum(w[g] for w in waiting) for g, c in enumerate(consumed)]
    state: dict[str, Any] = {
        "groups": names,
        "sources": [ctx.resize([old["sources"][g] for old in olds], handover=handover_keys(olds, g))
                    for g in range(n)],
        "buffer_keys": [],
        "carry_keys": [],
        "drops": {"stage": "DropCounter",  # the packer's DropCounter, saved as a nested stage
                  "state": {"counts": merge_counts(_drop_counts(old, i) for i, old in enumerate(olds)) if first else {}}},
        "num_batches": sum(int(old["num_batches"]) for old in olds) if first else 0,
        "consumed": consumed,
        "packed": summed("packed"),
        "group_drops": [merge_counts(old["group_drops"][g] for old in olds) if first else {} for g in range(n)],
    }
    missing = [f for f in fields if f not in state]
    if missing:  # a new declared field needs a rule here
        raise StateError(f"{_WHERE}: no resize rule for packer state fields {missing}")
    return state
