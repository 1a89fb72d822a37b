"""Training-side telemetry for the data pipeline: what a user watches while BAGEL trains.

Per log interval: step, tokens/s, fill ratio (real tokens / max_num_tokens), samples per pack, group mix
against the configured weights, buffer occupancy, drops by reason and the time spent waiting in
``next()``; and the straggler line: each DP rank's compute per step (``packing.cost.CostModel.cost`` of its
micro-batches, all-reduced over the DP group by :meth:`Telemetry.reduce_costs`), the straggler ratio (the
slowest rank's over the mean, averaged over the interval's steps) and the share of step time lost waiting for
the slowest rank (``sum(max - mean) / sum(max)``), whatever ``packer.strategy``. Written through ``logging``
and, when a directory is given, as TensorBoard scalars.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping

from ..config.schema import CostConfig
from ..packing.cost import CostModel

__all__ = ["StragglerStats", "Telemetry"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StragglerStats:
    """One interval's compute per step over the DP ranks (FLOPs; ``step_max[i]`` / ``step_mean[i]``: the slowest
    rank's and the mean rank's cost of the interval's ``i``-th step)."""

    dp_size: int
    step_max: tuple[float, ...]
    step_mean: tuple[float, ...]

    @property
    def ratio(self) -> float:
        """Mean over the steps of max / mean (1.0 = no rank waits)."""
        rs = [m / a for m, a in zip(self.step_max, self.step_mean) if a > 0]
        return sum(rs) / len(rs) if rs else 1.0

    @property
    def lost(self) -> float:
        """Share of step time the ranks spend waiting for the slowest: ``sum(max - mean) / sum(max)``."""
        total = sum(self.step_max)
        return (total - sum(self.step_mean)) / total if total > 0 else 0.0


class Telemetry:
    """Accumulates per-batch accounts and wait times; ``log`` emits one interval, ``summary`` the run.

    ``cost``: the model the pack costs are estimated for (``packer.cost``; default BAGEL-7B)."""

    def __init__(self, *, max_num_tokens: int, group_weights: Mapping[str, float], tensorboard_dir: str | None = None,
                 enabled: bool = True, cost: CostConfig | None = None) -> None:
        self.max_num_tokens = max_num_tokens
        self.cost_model = CostModel.of(cost)
        self.step_costs: dict[int, float] = {}  # this rank's cost per step of the interval (FLOPs)
        self.straggler_max = self.straggler_mean = 0.0  # the run's sums over steps (FLOPs)
        self.straggler_ratios: list[float] = []
        total = sum(group_weights.values()) or 1.0
        self.weight_share = {g: w / total for g, w in group_weights.items()}
        self.enabled = enabled
        self._writer = None
        if tensorboard_dir and enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(tensorboard_dir)
        self._t0 = self._tint = time.perf_counter()
        self.total = Counter()
        self.interval = Counter()
        self.groups_total: Counter = Counter()
        self.waits: list[float] = []
        self.interval_waits: list[float] = []

    def record(self, account: Mapping[str, Any], wait_s: float, step: int | None = None) -> None:
        """Add one batch's account (``batch_check.account_batch``) and the time ``next()`` took; ``step``: the
        training step the batch belongs to (its cost counts towards that step's; None: no cost recorded)."""
        if step is not None and "work" in account:
            self.step_costs[step] = self.step_costs.get(step, 0.0) + self.cost_model.cost(account["work"])
        for key in ("tokens", "padding", "ce_tokens", "mse_tokens", "samples", "images"):
            self.total[key] += account[key]
            self.interval[key] += account[key]
        self.total["batches"] += 1
        self.interval["batches"] += 1
        self.groups_total.update(account["groups"])
        self.waits.append(wait_s)
        self.interval_waits.append(wait_s)

    def reduce_costs(self, group: Any = None) -> StragglerStats:
        """All-reduce this interval's per-step costs over the DP ``group`` (max and sum; a collective: every rank
        of the group calls it at the same step, with the same steps recorded) and forget them."""
        import torch
        import torch.distributed as dist

        steps = sorted(self.step_costs)
        local = torch.tensor([self.step_costs[s] for s in steps], dtype=torch.float64)
        self.step_costs = {}
        if not dist.is_available() or not dist.is_initialized():
            return StragglerStats(1, tuple(local.tolist()), tuple(local.tolist()))
        high, total = local.clone(), local.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        n = dist.get_world_size(group)
        return StragglerStats(n, tuple(high.tolist()), tuple((total / n).tolist()))

    def log(self, step: int, pipeline: Mapping[str, Any], global_tokens: int | None = None,
            straggler: StragglerStats | None = None) -> dict[str, float]:
        """Emit and reset the interval; ``pipeline`` holds buffer_len and drops (packer + readers); ``straggler``:
        the interval's per-step costs over the DP ranks (:meth:`reduce_costs`)."""
        now = time.perf_counter()
        dt = max(now - self._tint, 1e-9)
        b = max(self.interval["batches"], 1)
        n_samples = max(sum(self.groups_total.values()), 1)
        mix = {g: self.groups_total.get(g, 0) / n_samples for g in self.weight_share}
        stats = {
            "tokens_per_s": (global_tokens if global_tokens is not None else self.interval["tokens"]) / dt,
            "fill_ratio": self.interval["tokens"] / (b * self.max_num_tokens),
            "samples_per_pack": self.interval["samples"] / b,
            "wait_ms_mean": 1000 * sum(self.interval_waits) / max(len(self.interval_waits), 1),
            "buffer_len": float(pipeline.get("buffer_len", 0)),
        }
        if straggler is not None and straggler.step_max:
            stats["straggler_ratio"] = straggler.ratio
            stats["straggler_lost"] = straggler.lost
            stats["tflops_per_pack"] = sum(straggler.step_mean) / len(straggler.step_mean) / 1e12
            self.straggler_max += sum(straggler.step_max)
            self.straggler_mean += sum(straggler.step_mean)
            self.straggler_ratios += [m / a for m, a in zip(straggler.step_max, straggler.step_mean) if a > 0]
        drops = dict(pipeline.get("drops", {}))
        unused = dict(pipeline.get("unused", {}))
        if self.enabled:
            logger.info(
                "step %d | %.0f tokens/s | fill %.3f | %.1f samples/pack | wait %.1f ms/batch | buffer %d | "
                "group mix %s (weights %s) | ignored record parts %s | drops %s", step, stats["tokens_per_s"], stats["fill_ratio"],
                stats["samples_per_pack"], stats["wait_ms_mean"], int(stats["buffer_len"]),
                {g: round(v, 3) for g, v in mix.items()}, {g: round(v, 3) for g, v in self.weight_share.items()},
                unused or "none", drops or "none")
            if "straggler_ratio" in stats:
                logger.info("step %d | straggler: compute max/mean over %d DP ranks %.4f, %.1f%% of step time "
                            "waiting for the slowest rank | %.1f TFLOPs per rank and step (estimated, packer.cost)",
                            step, straggler.dp_size, stats["straggler_ratio"], 100 * stats["straggler_lost"],
                            stats["tflops_per_pack"])
            if self._writer is not None:
                for key, value in stats.items():
                    self._writer.add_scalar(f"data/{key}", value, step)
                for g, v in mix.items():
                    self._writer.add_scalar(f"data/group_mix/{g}", v, step)
                for reason, count in drops.items():
                    self._writer.add_scalar(f"data/drops/{reason}", count, step)
                self._writer.flush()
        self.interval = Counter()
        self.interval_waits = []
        self._tint = now
        return stats

    def summary(self) -> dict[str, Any]:
        """Totals of the whole run (tokens, fill, wait mean/p95, group mix)."""
        waits = sorted(self.waits)
        p95 = waits[min(len(waits) - 1, int(0.95 * len(waits)))] if waits else 0.0
        b = max(self.total["batches"], 1)
        n = max(sum(self.groups_total.values()), 1)
        return {
            "batches": self.total["batches"],
            "tokens": self.total["tokens"],
            "fill_ratio": self.total["tokens"] / (b * self.max_num_tokens),
            "ce_tokens": self.total["ce_tokens"],
            "mse_tokens": self.total["mse_tokens"],
            "samples": self.total["samples"],
            "wait_ms_mean": 1000 * sum(waits) / max(len(waits), 1),
            "wait_ms_p95": 1000 * p95,
            "group_mix": {g: self.groups_total.get(g, 0) / n for g in self.weight_share},
            "straggler_ratio": (sum(self.straggler_ratios) / len(self.straggler_ratios)
                                if self.straggler_ratios else None),
            "straggler_lost": ((self.straggler_max - self.straggler_mean) / self.straggler_max
                               if self.straggler_max > 0 else None),
            "seconds": time.perf_counter() - self._t0,
        }

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
