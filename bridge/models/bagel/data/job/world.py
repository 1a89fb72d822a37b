"""The data pipeline's numbers over the whole data-parallel world: what rank 0 logs is every rank's.

Each rank counts only what it read and packed (``Telemetry``, ``BagelExternalLoader.stats()``). On the steps
the job needs the world's numbers (a log interval; every step under ``train.stop_at_epoch``: ``job.loop``) and at
the end of the run, ``reduce_world`` sums those counters over Megatron's ``dp`` group in one ``all_reduce`` of a
fixed-length vector and takes maxima in a second (the worst rank's wait, the oldest epoch a rank still reads);
the straggler meter's compute per step (``job.straggler``) rides in the same two vectors. The cost per rank is
two small collectives whatever the world size, partition count or corpus size: nothing per rank or per partition
travels.

The vector's layout is the same on every rank: the group names (from the config) and a fixed vocabulary of
reasons, ``DROP_VOCABULARY`` (the packer's and the cookers' reasons, ``END_OF_STREAM``, the official readers'
``missing_row_group``) and ``UNUSED_VOCABULARY``; a reason outside them (a future one) is counted under
``other`` and named in this rank's debug log. TP / PP / CP peers of a DP replica read identical streams, so only
the ``dp`` group is reduced.

Epochs (elastic order): every rank reports the oldest epoch it still reads per group
(``ElasticPlan.stats``); the minimum over the world is the group's count of **completed** epochs (every block of
the earlier epochs read by its rank; samples of them may still wait in a packer buffer). ``epochs_read`` is the
world's samples read from the group (``taken``, hand-overs of a resize not counted twice) over its samples per
epoch: the fractional progress. Under the official order neither exists (each worker cycles its own files).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ..energon.cooking import DROP_REASONS as COOK_DROP_REASONS
from ..energon.cooking import UNUSED_REASONS
from ..packing.packer import END_OF_STREAM
from ..packing.step import DROP_REASONS as PACK_DROP_REASONS
from .topology import collective_device

__all__ = ["DROP_VOCABULARY", "UNUSED_VOCABULARY", "reduce_world"]

logger = logging.getLogger(__name__)

OTHER = "other"
#: Every drop reason the pipeline can count, in the reduced vector's order (``other``: anything else).
DROP_VOCABULARY: tuple[str, ...] = (*PACK_DROP_REASONS, END_OF_STREAM, *COOK_DROP_REASONS, "missing_row_group", OTHER)
#: Every reason for an ignored part of a kept record (``BagelSample.unused``), then ``other``.
UNUSED_VOCABULARY: tuple[str, ...] = (*UNUSED_REASONS, OTHER)

#: Counters of one rank, summed over the world: the interval's and the run's (``Telemetry.local``).
_TELEMETRY_SUMS = ("interval_tokens", "interval_samples", "interval_batches", "interval_wait_s", "interval_waits",
                   "tokens", "samples", "batches", "ce_tokens", "mse_tokens", "wait_s", "waits")
_GROUP_SUMS = ("mix", "consumed", "packed", "buffered", "taken")


def _fold(counts: Mapping[str, int], vocabulary: Sequence[str], where: str) -> list[float]:
    """``counts`` as a vector over ``vocabulary`` (an unknown reason goes to ``other``, named at debug level)."""
    out = [0.0] * len(vocabulary)
    index = {r: i for i, r in enumerate(vocabulary)}
    for reason, n in counts.items():
        if reason not in index:
            logger.debug("%s: reason %r is not in the reduced vocabulary; counted as %r", where, reason, OTHER)
        out[index.get(reason, index[OTHER])] += float(n)
    return out


def _unfold(values: Sequence[float], vocabulary: Sequence[str]) -> dict[str, int]:
    return {r: int(round(v)) for r, v in zip(vocabulary, values) if v}


def reduce_world(telemetry: Mapping[str, float], pipeline: Mapping[str, Any], group_names: Sequence[str],
                 dp_group: Any = None, *, step_compute: Sequence[float] = ()) -> dict[str, Any]:
    """The world's numbers from this rank's ``telemetry`` (``Telemetry.local()``), ``pipeline``
    (``BagelExternalLoader.stats()``) and ``step_compute`` (``StragglerMeter.local()``: FLOPs per step, the same
    steps on every rank). A collective over ``dp_group``: every rank calls it at the same step. Without an
    initialized process group: this rank's numbers alone.

    Returns ``{"dp_size", **sums of _TELEMETRY_SUMS, "wait_ms_worst" (the worst rank's mean wait of the interval,
    ms), "wait_ms_p95_worst" (the worst rank's p95 over the run, ms; 0 unless ``telemetry`` holds ``wait_p95_s``:
    ``Telemetry.local(p95=True)``, for the summary), "buffer_len", "drops", "unused" ({reason: count}, zero counts
    left out), "drop_ranks" (ranks that dropped anything so far), "group_samples" ({group: samples packed}, for the
    mix), "groups": {group: {"epoch": completed epochs or None, "epochs_read": float or None, "consumed", "packed",
    "buffered", "dropped": {reason: count}}}, "step_compute_max", "step_compute_mean" (per step of ``step_compute``:
    the slowest rank's and the mean rank's FLOPs)}``; counts are ints.
    """
    import torch
    import torch.distributed as dist

    ledger = pipeline.get("ledger", {}) or {}
    source_drops = pipeline.get("source_drops", {}) or {}
    sources = pipeline.get("sources", {}) or {}
    drops = dict(pipeline.get("drops", {}) or {})
    sums = [float(telemetry.get(k, 0.0)) for k in _TELEMETRY_SUMS]
    sums += [float(pipeline.get("buffer_len", 0)), 1.0 if any(drops.values()) else 0.0]
    sums += _fold(drops, DROP_VOCABULARY, "drops")
    sums += _fold(pipeline.get("unused", {}) or {}, UNUSED_VOCABULARY, "unused")
    highs = [1000 * float(telemetry.get("interval_wait_s", 0.0)) / max(float(telemetry.get("interval_waits", 0)), 1.0),
             1000 * float(telemetry.get("wait_p95_s", 0.0))]
    mix = telemetry.get("group_samples", {}) or {}
    for g in group_names:
        own, src = ledger.get(g, {}), sources.get(g, {})
        sums += [float(mix.get(g, 0)), float(own.get("consumed", 0)), float(own.get("packed", 0)),
                 float(own.get("buffered", 0)), float(src.get("taken", 0))]
        dropped = dict(own.get("dropped", {}) or {})
        for reason, n in (source_drops.get(g, {}) or {}).items():
            dropped[reason] = dropped.get(reason, 0) + n
        sums += _fold(dropped, DROP_VOCABULARY, f"group {g} drops")
        epoch = src.get("epoch")
        # max over ranks of -epoch = -(the oldest epoch read); a rank that does not know (official order): +1
        highs += [-float(epoch) if epoch is not None else 1.0, float(src.get("epoch_size", 0))]
    sums += [float(f) for f in step_compute]
    highs += [float(f) for f in step_compute]
    device = collective_device(dp_group)
    s = torch.tensor(sums, dtype=torch.float64, device=device)
    m = torch.tensor(highs, dtype=torch.float64, device=device)
    dp_size = 1
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(s, op=dist.ReduceOp.SUM, group=dp_group)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=dp_group)
        dp_size = dist.get_world_size(dp_group)
    s_list, m_list = s.tolist(), m.tolist()
    out: dict[str, Any] = {"dp_size": dp_size}
    k = len(_TELEMETRY_SUMS)
    out.update({key: (v if key.endswith("_s") else int(round(v))) for key, v in zip(_TELEMETRY_SUMS, s_list[:k])})
    out["buffer_len"], out["drop_ranks"] = int(s_list[k]), int(s_list[k + 1])
    k += 2
    out["drops"] = _unfold(s_list[k:k + len(DROP_VOCABULARY)], DROP_VOCABULARY)
    k += len(DROP_VOCABULARY)
    out["unused"] = _unfold(s_list[k:k + len(UNUSED_VOCABULARY)], UNUSED_VOCABULARY)
    k += len(UNUSED_VOCABULARY)
    out["wait_ms_worst"], out["wait_ms_p95_worst"] = m_list[0], m_list[1]
    out["group_samples"], out["groups"] = {}, {}
    for j, g in enumerate(group_names):
        samples, consumed, packed, buffered, taken = (int(round(v)) for v in s_list[k:k + len(_GROUP_SUMS)])
        k += len(_GROUP_SUMS)
        dropped = _unfold(s_list[k:k + len(DROP_VOCABULARY)], DROP_VOCABULARY)
        k += len(DROP_VOCABULARY)
        neg_epoch, size = m_list[2 + 2 * j], m_list[3 + 2 * j]
        known = neg_epoch <= 0 and size > 0
        out["group_samples"][g] = samples
        out["groups"][g] = {"epoch": int(-neg_epoch) if known else None,
                            "epochs_read": round(taken / size, 3) if known else None,
                            "consumed": consumed, "packed": packed, "buffered": buffered, "dropped": dropped}
    out["step_compute_max"] = m_list[2 + 2 * len(group_names):]
    out["step_compute_mean"] = (s[k:] / dp_size).tolist()
    return out
