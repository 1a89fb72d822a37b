"""Elastic resume: the loader state of one new DP rank from the loader states of ALL old ranks (pure data).

A restart on another DP size (``data.order: elastic`` only) reads every old rank's state file and calls
:func:`resize_loader_states` once per new rank; the result is an ordinary loader state for
``BagelExternalLoader.restore_state``. Each stage resizes its own part (``resize_state`` classmethods registered
with ``state.register_resizable``, dispatched by ``state.ResizeContext``): the RNG iterator starts fresh streams
for (seed, new rank, generation), the packer hands its buffered samples to the group readers, the elastic readers
hand partitions (with their cursors) and handed-over samples to their new owners, and new rank 0 carries the
counters so that the ledger summed over the world is unchanged. Same inputs, same output: restoring one
checkpoint on one new topology twice gives the same batches.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ..energon import elastic_reader  # noqa: F401 - registers ElasticGroupReader.resize_state
from ..packing import packer  # noqa: F401 - registers BagelPacker.resize_state
from ..state import ResizeContext, StateError
from . import rng  # noqa: F401 - registers BagelRNGIterator.resize_state
from .loader import STATE_VERSION, fingerprint_diff

__all__ = ["ELASTIC_TOPOLOGY_KEYS", "resize_loader_states", "saved_world"]

logger = logging.getLogger(__name__)

#: Fingerprint keys the elastic order's stream does not depend on (its readers check their own DP rank and size).
ELASTIC_TOPOLOGY_KEYS = ("loader.dp_rank", "loader.dp_size", "loader.num_workers", "upstream.rank_seed")


def _generations(obj: Any) -> list[int]:
    """Resize generations recorded in a saved state (the elastic readers' ``world``)."""
    found: list[int] = []
    if isinstance(obj, Mapping):
        if obj.get("stage") == "ElasticGroupReader":
            found.append(int(obj["state"]["world"]["generation"]))
        else:
            for v in obj.values():
                found += _generations(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            found += _generations(v)
    return found


def saved_world(state: Mapping[str, Any]) -> tuple[str, int, int]:
    """``(order, dp_rank, dp_size)`` a loader state was saved under (from its fingerprint)."""
    loader = state.get("fingerprint", {}).get("loader", {}) if isinstance(state, Mapping) else {}
    return str(loader.get("order", "?")), int(loader.get("dp_rank", -1)), int(loader.get("dp_size", -1))


def resize_loader_states(olds: Sequence[Mapping[str, Any]], dp_rank: int, dp_size: int) -> dict[str, Any]:
    """The state of new DP rank ``dp_rank`` of ``dp_size`` from the states of every old rank (old rank order).

    Raises ``StateError`` (one line) when the states are not one complete elastic checkpoint: another order, a
    missing or duplicated rank, another state version, differing configurations or positions.
    """
    if not olds:
        raise StateError("elastic resize: no old loader states")
    for k, old in enumerate(olds):
        if not isinstance(old, Mapping) or old.get("version") != STATE_VERSION:
            got = old.get("version") if isinstance(old, Mapping) else type(old).__name__
            raise StateError(f"elastic resize: old rank {k}'s state has version {got!r}, this package reads "
                             f"{STATE_VERSION}")
        order, rank, size = saved_world(old)
        if order != "elastic":
            raise StateError(f"elastic resize: the checkpoint was written with data.order {order!r}, whose stream "
                             "depends on the DP size; restarts on another DP size need data.order: elastic")
        if (rank, size) != (k, len(olds)):
            raise StateError(f"elastic resize: state {k} of {len(olds)} was saved by DP rank {rank} of {size}; give "
                             "every old rank's file, in rank order")
        diff = fingerprint_diff(olds[0]["fingerprint"], old["fingerprint"], ELASTIC_TOPOLOGY_KEYS)
        if diff:
            raise StateError(f"elastic resize: old ranks 0 and {k} differ in configuration: {diff[0]}")
        if old["position"] != olds[0]["position"]:
            raise StateError(f"elastic resize: old ranks stopped at different batches ({olds[0]['position']} vs "
                             f"{old['position']} on rank {k}): the files are not from one checkpoint")
        if old.get("stateful_loaders"):
            raise StateError("elastic resize: a loader with hand-wired stateful_loaders cannot be resized")
    generation = 1 + max(_generations([o["upstream"] for o in olds]), default=0)
    seed = int(olds[0]["fingerprint"]["loader"]["seed"])
    ctx = ResizeContext(dp_rank, dp_size, generation, seed)
    fingerprint = copy.deepcopy(olds[0]["fingerprint"])
    fingerprint["loader"].update(dp_rank=dp_rank, dp_size=dp_size)
    state = {"version": STATE_VERSION, "fingerprint": fingerprint, "position": int(olds[0]["position"]),
             "upstream": ctx.resize([o["upstream"] for o in olds]), "stateful_loaders": []}
    logger.info("elastic resize: %d old ranks -> DP rank %d of %d at batch %d (generation %d)", len(olds), dp_rank,
                dp_size, state["position"], generation)
    return state
