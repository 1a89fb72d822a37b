"""The straggler line of the main job: how long the data-parallel ranks wait for the slowest one.

In a data-parallel step every rank waits at the gradient all-reduce for the rank with the most compute. Each rank
records the estimated compute of its micro-batches per step (``packing.cost.CostModel.cost`` of
``packing.cost.batch_work``; FLOPs, from ``packer.cost``); every logging interval :meth:`StragglerMeter.reduce`
all-reduces them over the DP group (max and sum: two collectives of one float64 per step of the interval) and
gives the **straggler ratio** (the slowest rank's compute over the mean, averaged over the interval's steps; 1.0 =
no rank waits) and the **lost share** (``sum(max - mean) / sum(max)``: the share of step time the average rank
spends waiting, if step time is proportional to compute). Whatever ``packer.strategy``: it measures what
``strategy: balanced`` removes. Estimated compute, not measured time (see ``packing/cost.py`` for what the model
leaves out).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

from ..config.schema import CostConfig
from ..packing.cost import CostModel, batch_work, straggler_ratio
from .topology import collective_device

__all__ = ["StragglerMeter", "StragglerStats"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StragglerStats:
    """One interval's compute per step over ``dp_size`` DP ranks (FLOPs): ``step_max[i]`` / ``step_mean[i]`` the
    slowest rank's and the mean rank's compute of the interval's ``i``-th step."""

    dp_size: int
    step_max: tuple[float, ...]
    step_mean: tuple[float, ...]

    @property
    def ratio(self) -> float:
        """Mean over the steps of max / mean (1.0 = no rank waits; ``packing.cost.straggler_ratio``)."""
        return straggler_ratio(self.step_max, self.step_mean)[0]

    @property
    def lost(self) -> float:
        """Share of step time the ranks spend waiting for the slowest: ``sum(max - mean) / sum(max)``."""
        return straggler_ratio(self.step_max, self.step_mean)[1]

    def scalars(self) -> dict[str, float]:
        """``straggler_ratio``, ``straggler_lost`` and ``tflops_per_step`` (the mean rank's, TFLOPs) for the
        interval's log and TensorBoard (``data/<name>``)."""
        mean = sum(self.step_mean) / len(self.step_mean) if self.step_mean else 0.0
        return {"straggler_ratio": self.ratio, "straggler_lost": self.lost, "tflops_per_step": mean / 1e12}


class StragglerMeter:
    """This rank's compute per training step, reduced over the DP group every logging interval.

    ``cost``: the model the batches' compute is estimated for (``packer.cost``; default BAGEL-7B); ``enabled``:
    this rank logs the line (rank 0). Usage per step: :meth:`record` each micro-batch; per interval, on every DP
    rank at the same step: :meth:`reduce` (a collective), then :meth:`log`.
    """

    def __init__(self, cost: CostConfig | None = None, *, enabled: bool = True) -> None:
        self.model = CostModel.of(cost)
        self.enabled = enabled
        self._steps: dict[int, float] = {}  # this rank's FLOPs per step of the current interval
        self._max: list[float] = []  # the run's steps so far: the slowest and the mean rank's FLOPs
        self._mean: list[float] = []

    def record(self, step: int, batch: Mapping[str, Any]) -> float:
        """Add one micro-batch of training step ``step`` (a packed batch, flex or dense); returns its FLOPs."""
        flops = self.model.cost(batch_work(batch))
        self._steps[step] = self._steps.get(step, 0.0) + flops
        return flops

    def reduce(self, group: Any = None) -> StragglerStats:
        """All-reduce the interval's per-step compute over the DP ``group`` (max and sum) and start a new interval.
        A collective: every rank of the group calls it at the same step, having recorded the same steps. Without
        an initialized process group: this rank alone (ratio 1.0)."""
        import torch
        import torch.distributed as dist

        local = torch.tensor([self._steps[s] for s in sorted(self._steps)], dtype=torch.float64,
                             device=collective_device(group))
        self._steps = {}
        if not dist.is_available() or not dist.is_initialized():
            return StragglerStats(1, tuple(local.tolist()), tuple(local.tolist()))
        high, total = local.clone(), local.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        n = dist.get_world_size(group)
        return StragglerStats(n, tuple(high.tolist()), tuple((total / n).tolist()))

    def log(self, step: int, stats: StragglerStats) -> dict[str, float]:
        """Add the interval to the run's totals and log its line (when ``enabled``); returns ``stats.scalars()``
        (empty for an interval without steps)."""
        if not stats.step_max:
            return {}
        self._max += stats.step_max
        self._mean += stats.step_mean
        out = stats.scalars()
        if self.enabled:
            logger.info("step %d | straggler: compute max/mean over %d DP ranks %.4f, %.1f%% of step time waiting "
                        "for the slowest rank | %.1f TFLOPs per rank and step (estimated, packer.cost)", step,
                        stats.dp_size, out["straggler_ratio"], 100 * out["straggler_lost"], out["tflops_per_step"])
        return out

    def summary(self) -> dict[str, float | None]:
        """The run's ``straggler_ratio`` (mean over its steps) and ``straggler_lost``; None before any interval."""
        ratio, lost = straggler_ratio(self._max, self._mean)
        return {"straggler_ratio": ratio if self._max else None, "straggler_lost": lost if sum(self._max) > 0 else None}
